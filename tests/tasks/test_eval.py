"""pass@k estimator (Chen et al. 2021)."""
import itertools
import math

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from lowrl.tasks.eval import pass_at_k, pass_at_k_from_rewards


@st.composite
def _nck(draw):
  n = draw(st.integers(1, 60))
  return n, draw(st.integers(0, n)), draw(st.integers(1, n))


@given(_nck())
def test_matches_binomial_formula(nck):
  n, c, k = nck
  exact = 1 - math.comb(n - c, k) / math.comb(n, k)
  assert pass_at_k(n, c, k) == pytest.approx(exact, rel=1e-12, abs=1e-12)


@pytest.mark.parametrize("n,c,k", [(5, 2, 2), (6, 1, 3), (7, 3, 4), (4, 0, 2), (5, 4, 2)])
def test_matches_subset_enumeration(n, c, k):
  """The definition: the share of size-k subsets of the n samples holding a correct one."""
  samples = [True] * c + [False] * (n - c)
  subsets = list(itertools.combinations(samples, k))
  assert pass_at_k(n, c, k) == pytest.approx(sum(any(s) for s in subsets) / len(subsets))


def test_edge_cases():
  assert pass_at_k(10, 0, 5) == 0.0
  assert pass_at_k(10, 10, 1) == 1.0
  assert pass_at_k(10, 6, 5) == 1.0  # only 4 wrong samples: any 5 include a correct one
  assert pass_at_k(10, 3, 1) == pytest.approx(0.3)
  assert pass_at_k(1000, 1, 1000) == 1.0
  assert 0.0 < pass_at_k(1000, 1, 10) < 0.011


@pytest.mark.parametrize("n,c,k,match", [
    (5, 6, 1, "0 <= c <= n"), (5, -1, 1, "0 <= c <= n"), (5, 2, 0, "1 <= k <= n"),
    (5, 2, 6, "1 <= k <= n"),
    (5.0, 2, 1, "integer counts")])
def test_invalid(n, c, k, match):
  with pytest.raises(ValueError, match=match):
    pass_at_k(n, c, k)


def test_from_rewards():
  rewards = np.array([[1.0, 0.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0], [1.0, 1.0, 0.2, 0.0]])
  expected = np.mean([pass_at_k(4, 1, 2), 0.0, pass_at_k(4, 2, 2)])
  assert pass_at_k_from_rewards(rewards, 2) == pytest.approx(expected)
  assert pass_at_k_from_rewards(rewards, 1, threshold=0.1) == pytest.approx((1 / 4 + 0 + 3 / 4) / 3)
  with pytest.raises(ValueError, match=r"\[N problems, G samples\]"):
    pass_at_k_from_rewards(np.ones(4), 1)
  with pytest.raises(ValueError, match="1 <= k <= n"):
    pass_at_k_from_rewards(rewards, 5)
