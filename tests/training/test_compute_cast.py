"""optimizer.compute_cast_rounding=stochastic (lowrl.training.compute_cast): the FP32 -> BF16
compute cast of the BF16 GEMMs' weights, rounded stochastically per update.

The neighbours are ml_dtypes': the BF16 value nearest x (its RNE cast) and its `np.nextafter`
towards x. Unbiasedness: each draw is lo or hi, hi with probability p = (x - lo) / (hi - lo), so
the mean of N independent draws is lo + (hi - lo) B / N, B ~ Binomial(N, p); Hoeffding gives
P(|B / N - p| >= t) <= 2 exp(-2 N t^2), and with a union bound over the M tested elements the
whole check fails with probability <= delta at t = sqrt(ln(2 M / delta) / (2 N)).
"""
import dataclasses
import math

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import optax
import pytest

import tiny
from lowrl.models import init
from lowrl.training import compute_cast
from lowrl.training.batch import RLBatch
from lowrl.training.rl_update import make_logprob_fn, make_rl_update
from lowrl.training.setup import build

BF16 = ml_dtypes.bfloat16
N_KEYS = 4096
DELTA = 1e-9  # failure probability of the whole unbiasedness check, were the bits ideal


def _neighbours(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
  """(lo, hi): the BF16 values around FP32 `x` (lo == hi == x when x is a BF16 value)."""
  r = x.astype(BF16)
  rf = r.astype(np.float32)
  toward = np.where(rf < x, np.inf, -np.inf).astype(BF16)
  other = np.where(rf == x, r, np.nextafter(r, toward)).astype(np.float32)
  return np.minimum(rf, other), np.maximum(rf, other)


def _values() -> np.ndarray:
  """FP32 values across binades and signs, FP32 and BF16 subnormals, zeros, exact BF16 values."""
  rng = np.random.default_rng(0)
  normal = (rng.standard_normal(200) * 10.0 ** rng.uniform(-6, 3, 200)).astype(np.float32)
  sub = np.array([1.3e-39, -7e-41, 2.0**-140, -(2.0**-145), 1e-45], np.float32)  # subnormals
  exact = np.array([1.0, -0.375, 2.0**-20, 0.0, -0.0, 1.0 + 2.0**-7], np.float32)
  near = np.array([1.0 + 2.0**-12, 1.0 - 2.0**-20, -3.0 - 2.0**-10], np.float32)  # tiny steps
  return np.concatenate([normal, sub, exact, near])


def _tree(x):
  return {"layers_0": {"attn": {"q_proj": {"kernel": jnp.asarray(x)}}},
          "norm": {"scale": jnp.asarray(x)}}


PATHS = (("layers_0", "attn", "q_proj", "kernel"),)


@pytest.fixture(scope="module")
def draws():
  x = _values()
  keys = jax.random.split(jax.random.key(11), N_KEYS)
  cast = jax.jit(jax.vmap(lambda k: compute_cast.stochastic_cast(_tree(x), PATHS, k)))
  out = cast(keys)
  return x, np.asarray(out["layers_0"]["attn"]["q_proj"]["kernel"]), out


def test_every_draw_is_a_bf16_neighbour_and_bf16_values_stay(draws):
  x, d, out = draws
  assert d.dtype == np.float32  # held FP32, on the BF16 grid
  lo, hi = _neighbours(x)
  assert np.all((d == lo) | (d == hi))
  exact = lo == hi
  assert exact.sum() >= 6 and np.all(d[:, exact] == x[exact])
  assert np.all(np.signbit(d[:, x == 0]) == np.signbit(x[x == 0]))  # -0 stays -0
  # Only the named leaves: the norm scale is untouched (bit for bit).
  assert np.array_equal(np.asarray(out["norm"]["scale"][0]).view(np.uint32), x.view(np.uint32))


def test_mean_over_keys_is_the_fp32_value(draws):
  x, d, _ = draws
  lo, hi = _neighbours(x)
  inexact = lo != hi
  t = math.sqrt(math.log(2 * inexact.sum() / DELTA) / (2 * N_KEYS))
  frac_up = np.mean(d[:, inexact] == hi[inexact], axis=0)
  p = ((x[inexact].astype(np.float64) - lo[inexact]) / (hi[inexact].astype(np.float64)
                                                         - lo[inexact]))
  assert np.all(np.abs(frac_up - p) <= t), np.max(np.abs(frac_up - p))
  # The tiny steps that round-to-nearest erases survive on average (1 + 2^-12 -> 1 under RTN).
  assert float(np.float32(1.0 + 2.0**-12).astype(BF16)) == 1.0
  k = int(np.flatnonzero(x == np.float32(1.0 + 2.0**-12))[0])
  assert abs(d[:, k].astype(np.float64).mean() - x[k]) <= t * (hi[k] - lo[k])


def test_specials_and_keys():
  x = np.array([np.nan, np.inf, -np.inf, 0.0, -0.0, 0.3, -1e-3], np.float32)
  a = compute_cast.stochastic_cast(_tree(x), PATHS, jax.random.key(0))
  w = np.asarray(a["layers_0"]["attn"]["q_proj"]["kernel"])
  assert np.isnan(w[0]) and w[1] == np.inf and w[2] == -np.inf
  assert w[3] == 0 and not np.signbit(w[3]) and w[4] == 0 and np.signbit(w[4])
  # Same key: the same cast; another key: another cast (elements that are not BF16 values).
  y = np.random.default_rng(1).standard_normal(512).astype(np.float32)
  c = lambda k: np.asarray(compute_cast.stochastic_cast(_tree(y), PATHS, k)  # noqa: E731
                           ["layers_0"]["attn"]["q_proj"]["kernel"])
  assert np.array_equal(c(jax.random.key(3)), c(jax.random.key(3)))
  assert np.mean(c(jax.random.key(3)) != c(jax.random.key(4))) > 0.2
  # Update keys: a stream of the step's update key, one per update.
  k0, k1 = compute_cast.update_key(jax.random.key(5), 0), compute_cast.update_key(jax.random.key(5), 1)
  assert not np.array_equal(c(k0), c(k1))


def test_cast_paths_are_the_bf16_gemms_kernels():
  setup = build(tiny.loop_config("bf16"))
  paths = compute_cast.cast_paths(setup.model_cfg, setup.trainer_policy)
  n = setup.model_cfg.n_layers
  assert len(paths) == 7 * n and all(p[-1] == "kernel" and p[0].startswith("layers_")
                                     for p in paths)  # tied head: the embedding is not cast


@pytest.mark.parametrize("edit, message", [
    (lambda c: c.precision.update(compute_dtype="float32", name="fp32"),
     "precision.compute_dtype='float32'; set --config.precision.compute_dtype=bfloat16"),
    (lambda c: c.optimizer.update(master_dtype="bfloat16"),
     "optimizer.master_dtype='bfloat16' computes on the master itself"),
    (lambda c: c.precision.update(format="nvfp4"), "precision.format='nvfp4' quantizes"),
])
def test_bad_combinations_are_one_line_errors(edit, message):
  c = tiny.loop_config("bf16")
  c.optimizer.compute_cast_rounding = "stochastic"
  edit(c)
  with pytest.raises(ValueError) as e:
    build(c)
  assert str(e.value).startswith("--config.optimizer.compute_cast_rounding=stochastic")
  assert message in str(e.value) and "\n" not in str(e.value), str(e.value)


def test_jitted_update_with_the_stochastic_cast_is_deterministic():
  """The update with the knob: deterministic given the key, a different key gives different
  weights, and it is not the nearest-cast update (its forward ran on other weights)."""
  cfg = tiny.loop_config("bf16")
  cfg.model.n_layers = 1
  cfg.rl.update(num_prompts=2, group_size=4, max_new_tokens=4, log_kl_ref=False)
  cfg.optimizer.compute_cast_rounding = "stochastic"
  setup = build(cfg)
  assert setup.update_cfg.compute_cast
  rows, t = setup.batch_size, setup.task.max_prompt_len + 4
  tokens = jax.random.randint(jax.random.key(1), (rows, t), 3, setup.model_cfg.vocab_size)
  mask = jnp.ones((rows, t), jnp.float32).at[:, : t - 4].set(0)
  batch = RLBatch(tokens_BT=tokens, input_mask_BT=jnp.ones((rows, t), jnp.float32),
                  loss_mask_BT=mask, logp_sampler_BT=-0.5 * mask,
                  adv_B=jnp.linspace(-1.0, 1.0, rows))
  params = init.init_params(setup.model_cfg, jax.random.key(0))
  lp = make_logprob_fn(setup.model_cfg, setup.trainer_policy, setup.sampling)
  tx = optax.sgd(1.0)  # params - new = the gradient: it sees the cast's weights directly

  def run(update_cfg, key):
    upd = jax.jit(make_rl_update(lp, tx, update_cfg))
    new, _, _ = upd(params, tx.init(params), None, batch, key)
    return [np.asarray(x) for x in jax.tree.leaves(new)]

  a, b = run(setup.update_cfg, jax.random.key(7)), run(setup.update_cfg, jax.random.key(7))
  assert all(np.array_equal(x, y) for x, y in zip(a, b))
  c = run(setup.update_cfg, jax.random.key(8))
  assert not all(np.array_equal(x, y) for x, y in zip(a, c))
  nearest = run(dataclasses.replace(setup.update_cfg, compute_cast=()), jax.random.key(7))
  assert not all(np.array_equal(x, y) for x, y in zip(a, nearest))
  # The master weights stay FP32 (the cast copy is only what the update computes on).
  assert all(x.dtype == np.float32 for x in a)


def test_trainer_scores_pi_old_on_the_compute_copy():
  """With the knob the sampler samples the master weights (nearest cast) and the trainer scores
  pi_old on update 0's stochastic compute copy (`cast_key`): a mismatch that the nearest cast,
  scored by the same trainer, does not have."""
  from lowrl.training.trainer import Trainer  # noqa: PLC0415 (the heavy import, this test only)
  cfg = tiny.loop_config("bf16")
  cfg.model.n_layers = 1
  cfg.rl.update(num_prompts=2, group_size=4, max_new_tokens=4, log_kl_ref=False)
  cfg.optimizer.compute_cast_rounding = "stochastic"
  trainer = Trainer(build(cfg), log=lambda _: None)
  params = init.init_params(trainer.setup.model_cfg, jax.random.key(0))
  key = jax.random.key(1)
  plain, _ = trainer.rollout(params, params, 0, key, stale=False)
  cast, _ = trainer.rollout(params, params, 0, key, stale=False,
                            cast_key=compute_cast.update_key(key, 0))
  mask = np.asarray(plain.out.completion_mask) > 0
  assert mask.sum() > 0 and np.array_equal(plain.out.tokens, cast.out.tokens)
  # Same program, same (nearest-cast) weights: the sampler's record exactly.
  assert np.array_equal(np.asarray(plain.logp_now_BT)[mask], np.asarray(plain.out.logprobs)[mask])
  assert not np.array_equal(np.asarray(cast.logp_now_BT)[mask], np.asarray(cast.out.logprobs)[mask])
