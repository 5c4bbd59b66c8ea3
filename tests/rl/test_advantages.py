"""GRPO / Dr.GRPO / RLOO advantages, dynamic-sampling signal and the DAPO overlong ramp."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lowrl.rl.advantages import compute_advantages, group_has_signal, overlong_penalty

G = 4


@pytest.fixture
def rewards():
  return np.array([1, 0, 0, 1,  3, 3, 3, 3,  0.5, 2, -1, 0], np.float32)


def _np_reference(r, g, mode, eps=1e-6, ddof=0):
  out = np.zeros_like(r, dtype=np.float64)
  for start in range(0, len(r), g):
    grp = r[start:start + g].astype(np.float64)
    for j in range(g):
      if mode == "grpo":
        out[start + j] = (grp[j] - grp.mean()) / (grp.std(ddof=ddof) + eps)
      elif mode == "drgrpo":
        out[start + j] = grp[j] - grp.mean()
      else:  # leave-one-out baseline, written literally
        others = np.delete(grp, j)
        out[start + j] = grp[j] - others.mean()
  return out


@pytest.mark.parametrize("mode", ["grpo", "drgrpo", "rloo"])
@pytest.mark.parametrize("ddof", [0, 1])
def test_matches_numpy(rewards, mode, ddof):
  adv = compute_advantages(jnp.asarray(rewards), G, mode, std_ddof=ddof)
  assert adv.shape == rewards.shape and adv.dtype == jnp.float32
  np.testing.assert_allclose(adv, _np_reference(rewards, G, mode, ddof=ddof), rtol=1e-5,
                             atol=1e-6)


def test_std_ddof_closed_form():
  # [1, 0, 0, 0]: mean 1/4, squared deviations sum to 3/4. Population std sqrt(3/16), sample std
  # sqrt(1/4) = 1/2: A_0 = (3/4) / std = sqrt(3) = 1.732 (ddof 0, the GRPO paper) vs 1.5 (ddof 1,
  # TRL / verl / tunix).
  r = jnp.array([1.0, 0.0, 0.0, 0.0])
  np.testing.assert_allclose(compute_advantages(r, 4, "grpo", eps=0.0, std_ddof=0),
                             np.array([3, -1, -1, -1]) / np.sqrt(3), rtol=1e-6)
  np.testing.assert_allclose(compute_advantages(r, 4, "grpo", eps=0.0, std_ddof=1),
                             [1.5, -0.5, -0.5, -0.5], rtol=1e-6)
  # The std only scales GRPO: Dr.GRPO and RLOO ignore the knob.
  for mode in ("drgrpo", "rloo"):
    np.testing.assert_array_equal(compute_advantages(r, 4, mode, std_ddof=1),
                                  compute_advantages(r, 4, mode, std_ddof=0))


# Rewards that are not exact in float32; the float32 mean of G copies of them is not always the
# value itself (e.g. 3 x 2.9, 6 x 4/6), which used to leave same-sign advantages like -0.19.
INEXACT_REWARDS = [2.9, 4 / 6, 0.1, 1 / 3, 0.7, 1e7 + 0.3, -0.3]


@pytest.mark.parametrize("group_size", [3, 6, 8])
@pytest.mark.parametrize("mode", ["grpo", "drgrpo", "rloo"])
@pytest.mark.parametrize("ddof", [0, 1])
@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_equal_inexact_rewards_give_exactly_zero(group_size, mode, ddof, jit):
  # One group per value, plus a group with signal that must keep its usual advantages.
  signal = np.linspace(0.0, 1.0, group_size, dtype=np.float32)
  r = np.concatenate([np.full(group_size, v, np.float32) for v in INEXACT_REWARDS] + [signal])
  f = functools.partial(compute_advantages, group_size=group_size, mode=mode, std_ddof=ddof)
  adv = np.asarray((jax.jit(f) if jit else f)(jnp.asarray(r)))
  n_equal = len(INEXACT_REWARDS) * group_size
  np.testing.assert_array_equal(adv[:n_equal], 0.0)
  np.testing.assert_allclose(adv[n_equal:], _np_reference(signal, group_size, mode, ddof=ddof),
                             rtol=1e-5, atol=1e-6)


def test_equal_rewards_with_zero_eps_are_zero_not_nan():
  adv = compute_advantages(jnp.full((4,), 2.9), 4, "grpo", eps=0.0)
  np.testing.assert_array_equal(adv, 0.0)


def test_grpo_hand_values():
  # Group [1, 0, 0, 1]: mean 0.5, population std 0.5.
  adv = compute_advantages(jnp.array([1.0, 0.0, 0.0, 1.0]), 4, "grpo", eps=0.0)
  np.testing.assert_allclose(adv, [1, -1, -1, 1], rtol=1e-6)
  np.testing.assert_allclose(compute_advantages(jnp.array([1.0, 0.0, 0.0, 1.0]), 4, "rloo"),
                             [1 - 1 / 3, -2 / 3, -2 / 3, 1 - 1 / 3], rtol=1e-6)


@pytest.mark.parametrize("mode", ["grpo", "drgrpo", "rloo"])
def test_identical_group_gets_zero(rewards, mode):
  adv = np.asarray(compute_advantages(jnp.asarray(rewards), G, mode))
  np.testing.assert_array_equal(adv[4:8], 0.0)
  # Group-relative advantages sum to zero within every group.
  np.testing.assert_allclose(adv.reshape(-1, G).sum(1), 0.0, atol=1e-5)


def test_jit_with_static_args(rewards):
  f = jax.jit(compute_advantages, static_argnames=("group_size", "mode"))
  np.testing.assert_allclose(f(jnp.asarray(rewards), group_size=G, mode="rloo"),
                             _np_reference(rewards, G, "rloo"), rtol=1e-5, atol=1e-6)


def test_bad_inputs(rewards):
  with pytest.raises(ValueError, match="multiple of group_size"):
    compute_advantages(jnp.asarray(rewards), 5, "grpo")
  with pytest.raises(ValueError, match="group_size >= 2"):
    compute_advantages(jnp.asarray(rewards), 1, "rloo")
  with pytest.raises(ValueError, match="drgrpo"):
    compute_advantages(jnp.asarray(rewards), G, "ppo")
  with pytest.raises(ValueError, match="positive int"):
    compute_advantages(jnp.asarray(rewards), 0, "grpo")
  for bad in (2, -1, 0.5, True):
    with pytest.raises(ValueError, match="rl.std_ddof"):
      compute_advantages(jnp.asarray(rewards), G, "grpo", std_ddof=bad)
  with pytest.raises(ValueError, match="std_ddof=1 .* group_size >= 2"):
    compute_advantages(jnp.asarray(rewards), 1, "grpo", std_ddof=1)


def test_group_has_signal(rewards):
  sig = np.asarray(group_has_signal(jnp.asarray(rewards), G))
  assert sig.dtype == np.bool_
  np.testing.assert_array_equal(sig, [True] * 4 + [False] * 4 + [True] * 4)
  # A difference in one member is enough.
  np.testing.assert_array_equal(group_has_signal(jnp.array([1.0, 1.0, 1.0, 0.0]), 4), [True] * 4)


def test_overlong_penalty_ramp():
  lengths = jnp.array([10, 16, 17, 18, 19, 20, 21, 100])
  out = overlong_penalty(lengths, max_len=20, cache_len=4)
  np.testing.assert_allclose(out, [0, 0, -0.25, -0.5, -0.75, -1, -1, -1], rtol=1e-6)
  assert out.dtype == jnp.float32
  f = jax.jit(functools.partial(overlong_penalty, max_len=20, cache_len=4))
  np.testing.assert_allclose(f(lengths), out)
  with pytest.raises(ValueError, match="cache_len"):
    overlong_penalty(lengths, max_len=20, cache_len=0)
  with pytest.raises(ValueError, match="cache_len"):
    overlong_penalty(lengths, max_len=20, cache_len=21)
