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


def _np_reference(r, g, mode, eps=1e-6):
  out = np.zeros_like(r, dtype=np.float64)
  for start in range(0, len(r), g):
    grp = r[start:start + g].astype(np.float64)
    for j in range(g):
      if mode == "grpo":
        out[start + j] = (grp[j] - grp.mean()) / (grp.std() + eps)
      elif mode == "drgrpo":
        out[start + j] = grp[j] - grp.mean()
      else:  # leave-one-out baseline, written literally
        others = np.delete(grp, j)
        out[start + j] = grp[j] - others.mean()
  return out


@pytest.mark.parametrize("mode", ["grpo", "drgrpo", "rloo"])
def test_matches_numpy(rewards, mode):
  adv = compute_advantages(jnp.asarray(rewards), G, mode)
  assert adv.shape == rewards.shape and adv.dtype == jnp.float32
  np.testing.assert_allclose(adv, _np_reference(rewards, G, mode), rtol=1e-5, atol=1e-6)


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
