"""lowrl.tasks.success against the definitions: pass@k by enumerating every size-k subset of
the n samples (small n), by scipy.special.comb (exact integers) for n = 64, and p_hat / the
zero fraction worked by hand."""
import itertools

import numpy as np
import pytest
import scipy.special

from lowrl.tasks import success


def _enumerated(n: int, c: int, k: int) -> float:
  """The share of size-k subsets of n samples (c correct) that hold a correct one."""
  samples = [True] * c + [False] * (n - c)
  subsets = list(itertools.combinations(samples, k))
  return sum(any(s) for s in subsets) / len(subsets)


def test_summary_matches_subset_enumeration():
  n, counts = 6, [0, 1, 2, 5, 6, 3]
  s = success.success_summary(counts, n)
  assert set(s) == {"p_hat", "zero_frac", "pass@1", "pass@2", "pass@4"}
  for k in (1, 2, 4):
    want = np.mean([_enumerated(n, c, k) for c in counts])
    assert s[f"pass@{k}"] == pytest.approx(want, rel=1e-12)
  assert s["p_hat"] == pytest.approx(17 / 36, rel=1e-12)  # (0+1+2+5+6+3) / (6 prompts x 6)
  assert s["zero_frac"] == pytest.approx(1 / 6)
  assert s["pass@1"] == pytest.approx(s["p_hat"], rel=1e-12)


@pytest.mark.parametrize("k", [1, 2, 8, 32, 64])
def test_per_prompt_matches_scipy_comb_at_n64(k):
  n = 64
  counts = np.array([0, 1, 2, 7, 32, 63, 64])
  exact = [1 - scipy.special.comb(n - c, k, exact=True) / scipy.special.comb(n, k, exact=True)
           for c in counts]
  np.testing.assert_allclose(success.pass_at_k_per_prompt(counts, n, k), exact, rtol=1e-12,
                             atol=1e-15)


def test_pass_at_n_is_one_minus_zero_fraction():
  counts = np.array([0, 0, 3, 64, 1])
  s = success.success_summary(counts, 64)
  assert s["pass@64"] == pytest.approx(1 - s["zero_frac"]) and s["zero_frac"] == 0.4


def test_powers_of_two():
  assert success.powers_of_two(64) == (1, 2, 4, 8, 16, 32, 64)
  assert success.powers_of_two(100) == (1, 2, 4, 8, 16, 32, 64)
  assert success.powers_of_two(1) == (1,)


@pytest.mark.parametrize("counts,match", [
    ([0, -1], r"outside \[0, n=4\]"), ([5], r"outside \[0, n=4\]"), ([], "P >= 1"),
    ([1.0], "integer counts"), ([[1]], "P >= 1")])
def test_invalid(counts, match):
  with pytest.raises(ValueError, match=match):
    success.success_summary(np.asarray(counts, dtype=float if counts == [1.0] else int), 4)
