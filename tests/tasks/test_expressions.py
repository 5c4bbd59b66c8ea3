"""Safe arithmetic-expression parsing (`lowrl.tasks.expressions`): what parses to which value and
numbers, what is refused, and render/parse round trips."""
from fractions import Fraction

import pytest
from hypothesis import assume, given
from hypothesis import strategies as st

from lowrl.tasks import expressions
from lowrl.tasks.expressions import ExpressionError, parse_expression


@pytest.mark.parametrize("text,value,used", [
    ("3*7+20", 41, [3, 7, 20]), ("(25-7)*2", 36, [25, 7, 2]), (" 3 * ( 7 + 20 ) ", 81, [3, 7, 20]),
    ("7/2*2", 7, [7, 2, 2]), ("20-3-7", 10, [20, 3, 7]), ("20-(3-7)", 24, [20, 3, 7]),
    ("2*3/4", Fraction(3, 2), [2, 3, 4]), ("0", 0, [0]), ("((5))", 5, [5])])
def test_parse_valid(text, value, used):
  assert parse_expression(text) == (value, used)


@pytest.mark.parametrize("text", [
    "", "   ", "3+", "+3", "-3+4", "3 4", "(3+4", "3+4)", "()", "3**2", "3^2", "2.5", "07+1",
    "3+x", "__import__('os')", "3=3", "1/0", "1/(2-2)", "4*(5/(3-3))", "9" * 40,
    "(" * 40 + "1" + ")" * 40, "\uff13+4"])
def test_parse_rejects(text):
  with pytest.raises(ExpressionError):
    parse_expression(text)


def test_parse_allows_moderate_nesting():
  assert parse_expression("(" * 20 + "1" + ")" * 20) == (1, [1])


_trees = st.recursive(st.integers(0, 30),
                      lambda kids: st.tuples(st.sampled_from("+-*/"), kids, kids), max_leaves=6)


@given(_trees)
def test_render_parse_round_trip(tree):
  """Minimal parentheses never change the value: parse(render(t)) == evaluate(t)."""
  try:
    value = expressions.evaluate(tree)
  except ExpressionError:
    assume(False)  # divides by zero
  text = expressions.render(tree)
  got, used = parse_expression(text)
  assert got == value
  assert used == _leaves(tree)


def _leaves(node):
  return [node] if isinstance(node, int) else _leaves(node[1]) + _leaves(node[2])
