"""Arithmetic expressions over non-negative integers: a safe parser/evaluator and a renderer.

Used by the countdown task. The grammar is integers, + - * /, parentheses and spaces; there is
no unary minus. Evaluation is exact (Fraction), so 7/2*2 is 7 and no float rounding decides a
reward. Nothing is passed to eval(); nesting depth and literal length are capped so hostile
strings cannot recurse deeply or build huge integers.
"""
from __future__ import annotations

from fractions import Fraction
from typing import Union

# An expression tree: an integer leaf or (op, left, right).
Node = Union[int, tuple[str, "Node", "Node"]]

PRECEDENCE = {"+": 1, "-": 1, "*": 2, "/": 2}
MAX_DEPTH = 32  # parenthesis nesting
MAX_LITERAL_DIGITS = 12


class ExpressionError(ValueError):
  """A string that is not a well-formed expression, or one that divides by zero."""


def apply_op(op: str, a: Fraction, b: Fraction) -> Fraction:
  """a op b, exactly; division by zero raises ExpressionError."""
  if op == "+":
    return a + b
  if op == "-":
    return a - b
  if op == "*":
    return a * b
  if op == "/":
    if b == 0:
      raise ExpressionError("division by zero")
    return a / b
  raise ExpressionError(f"unknown operator {op!r}")


def evaluate(node: Node) -> Fraction:
  """Exact value of an expression tree."""
  if isinstance(node, int):
    return Fraction(node)
  op, left, right = node
  return apply_op(op, evaluate(left), evaluate(right))


def render(node: Node) -> str:
  """The tree as text with the fewest parentheses that keep its value (no spaces)."""
  return _render(node, 0, False, "")


def _render(node: Node, parent_prec: int, is_right: bool, parent_op: str) -> str:
  if isinstance(node, int):
    return str(node)
  op, left, right = node
  p = PRECEDENCE[op]
  s = _render(left, p, False, op) + op + _render(right, p, True, op)
  # Left-to-right evaluation: a right operand of - or / at the same level needs parentheses.
  if p < parent_prec or (is_right and p == parent_prec and parent_op in "-/"):
    return f"({s})"
  return s


def _tokenize(text: str) -> list[str]:
  tokens = []
  i = 0
  while i < len(text):
    c = text[i]
    if c.isspace():
      i += 1
    elif c in "0123456789":
      j = i
      while j < len(text) and text[j] in "0123456789":
        j += 1
      lit = text[i:j]
      if len(lit) > 1 and lit[0] == "0":
        raise ExpressionError(f"number with a leading zero {lit!r}")
      if len(lit) > MAX_LITERAL_DIGITS:
        raise ExpressionError(f"number longer than {MAX_LITERAL_DIGITS} digits")
      tokens.append(lit)
      i = j
    elif c in "+-*/()":
      tokens.append(c)
      i += 1
    else:
      raise ExpressionError(f"disallowed character {c!r} at position {i}")
  return tokens


class _Parser:
  """Recursive descent: expr := term (('+'|'-') term)*; term := factor (('*'|'/') factor)*;
  factor := NUMBER | '(' expr ')'."""

  def __init__(self, tokens: list[str]):
    self.tokens = tokens
    self.pos = 0
    self.numbers: list[int] = []

  def peek(self) -> str | None:
    return self.tokens[self.pos] if self.pos < len(self.tokens) else None

  def take(self) -> str:
    tok = self.peek()
    if tok is None:
      raise ExpressionError("unexpected end of expression")
    self.pos += 1
    return tok

  def expr(self, depth: int) -> Fraction:
    value = self.term(depth)
    while self.peek() in ("+", "-"):
      op = self.take()
      value = apply_op(op, value, self.term(depth))
    return value

  def term(self, depth: int) -> Fraction:
    value = self.factor(depth)
    while self.peek() in ("*", "/"):
      op = self.take()
      value = apply_op(op, value, self.factor(depth))
    return value

  def factor(self, depth: int) -> Fraction:
    tok = self.take()
    if tok == "(":
      if depth >= MAX_DEPTH:
        raise ExpressionError(f"parentheses nested deeper than {MAX_DEPTH}")
      value = self.expr(depth + 1)
      if self.take() != ")":
        raise ExpressionError("missing ')'")
      return value
    if tok.isdigit():
      self.numbers.append(int(tok))
      return Fraction(int(tok))
    raise ExpressionError(f"unexpected {tok!r}")


def parse_expression(text: str) -> tuple[Fraction, list[int]]:
  """(exact value, integer literals in order of appearance) of `text`.

  Raises:
    ExpressionError: disallowed characters, malformed syntax (including unary minus), leading
      zeros, too-deep nesting, or division by zero.
  """
  tokens = _tokenize(text)
  if not tokens:
    raise ExpressionError("empty expression")
  parser = _Parser(tokens)
  value = parser.expr(0)
  if parser.peek() is not None:
    raise ExpressionError(f"unexpected {parser.peek()!r} after a complete expression")
  return value, parser.numbers
