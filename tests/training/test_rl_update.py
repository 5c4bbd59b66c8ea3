"""Gradient accumulation (`rl.micro_batches`) against the plain update, and its validation."""
import dataclasses
import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import tiny
from lowrl.rl.losses import aggregation_denominator
from lowrl.training import schema
from lowrl.training.setup import build
from lowrl.models import init
from lowrl.training.rl_update import make_logprob_fn, make_rl_update
from lowrl.training.batch import RLBatch

U = 2.0**-24  # FP32 unit roundoff


def _setup(aggregation: str):
  cfg = tiny.loop_config("fp32")
  cfg.model.n_layers = 1  # the bound does not depend on the depth: the smaller programs
  cfg.rl.update(num_prompts=4, group_size=4, max_new_tokens=4, aggregation=aggregation,
                log_kl_ref=False)
  return build(cfg)


def _batch(setup) -> RLBatch:
  """16 made-up rollouts (prompt columns, then completions of varied lengths; one empty)."""
  rows, p = setup.batch_size, setup.task.max_prompt_len
  t = p + setup.sampling.max_new_tokens
  k1, k2, k3 = jax.random.split(jax.random.key(3), 3)
  tokens = jax.random.randint(k1, (rows, t), 3, setup.model_cfg.vocab_size)
  lengths = jax.random.randint(k2, (rows,), 1, t - p + 1).at[5].set(0)
  col = jnp.arange(t)
  loss_mask = ((col >= p) & (col < p + lengths[:, None])).astype(jnp.float32)
  input_mask = (col < p + lengths[:, None]).astype(jnp.float32)
  return RLBatch(tokens_BT=tokens, input_mask_BT=input_mask, loss_mask_BT=loss_mask,
                 logp_sampler_BT=-jax.random.uniform(k3, (rows, t)) * loss_mask,
                 adv_B=jnp.linspace(-1.0, 1.0, rows))


@functools.lru_cache(maxsize=None)
def _update(aggregation: str, micro_batches: int):
  setup = _setup(aggregation)
  # SGD with lr 1: params - update = the gradient (up to the subtraction's rounding).
  cfg = dataclasses.replace(setup.update_cfg, micro_batches=micro_batches)
  return setup, jax.jit(make_rl_update(make_logprob_fn(setup.model_cfg, setup.trainer_policy),
                                       optax.sgd(1.0), cfg))


def _grad(aggregation, micro_batches, params, batch):
  """(-update as the gradient, float64 leaves; metrics)."""
  return tiny.sgd_gradient(_update(aggregation, micro_batches)[1], params, None, batch)


# Each aggregation with one split (every micro-batch program is its own compile): 2 and 4
# micro-batches of the 16-row minibatch are both covered, each aggregation against its plain step.
@pytest.mark.parametrize("aggregation, micro_batches", [("token_mean", 4),
                                                        ("seq_mean_token_mean", 2)])
def test_micro_batches_equal_the_plain_step_within_the_summation_order_bound(aggregation,
                                                                              micro_batches):
  """Bound. Both programs compute the same real function: the minibatch gradient is
  g = sum_r G_r over rows r, G_r = share_r * (gradient of row r's loss alone), share_r = row r's
  part of the aggregation's denominator (tokens, or valid sequences). They differ in FP32 only by
  (a) the order of the sums over rows and tokens (<= B*T terms per element: 2 gamma_{BT} sum|G_r|)
  and (b) each row's loss weight (S_k / n_k * n_k / N vs S / N: <= 3 roundings, 3u relative; the
  backward is linear in it). SGD's subtraction adds u (|p| + |g|) on each side, and measuring
  each G_r the same way adds u (|p| + |G_r|) per row. So elementwise
  |g_micro - g_plain| <= (2 gamma_{BT} + 3u) S + 2u (|p| + |g|) + 2u (B |p| + S),  S = sum_r |G_r|.
  """
  setup, _ = _update(aggregation, 1)
  params = jax.tree.map(np.asarray, init.init_params(setup.model_cfg,
                                                                 jax.random.key(0)))
  batch = _batch(setup)
  rows, t = batch.loss_mask_BT.shape
  g_plain, m_plain = _grad(aggregation, 1, params, batch)
  # Per-row gradients: row r alone, scaled by its share of the denominator.
  den = float(aggregation_denominator(batch.loss_mask_BT, aggregation))
  s = [np.zeros_like(x) for x in g_plain]
  for r in range(rows):
    alone = batch.loss_mask_BT * (jnp.arange(rows) == r)[:, None]
    share = float(aggregation_denominator(alone, aggregation)) / den
    if share:
      g_r, _ = _grad(aggregation, 1, params, batch._replace(loss_mask_BT=alone))
      s = [a + share * np.abs(b) for a, b in zip(s, g_r)]
  gamma = rows * t * U / (1 - rows * t * U)
  p_abs = [np.abs(np.asarray(x, np.float64)) for x in jax.tree.leaves(params)]
  assert max(np.abs(x).max() for x in g_plain) > 1e-3  # a real gradient
  g_micro, m_micro = _grad(aggregation, micro_batches, params, batch)
  for gm, gp, sr, pa in zip(g_micro, g_plain, s, p_abs):
    bound = (2 * gamma + 3 * U) * sr + 2 * U * (pa + np.abs(gp)) + 2 * U * (rows * pa + sr)
    np.testing.assert_array_less(np.abs(gm - gp), bound + 1e-30)
  # Scalars: sums of <= B*T terms, relative error <= gamma_{BT} + 3u < 1e-5.
  for key in ("loss", "pg_loss", "clip_frac", "ratio_mean", "entropy", "grad_norm"):
    assert m_micro[key] == pytest.approx(m_plain[key], rel=1e-5, abs=1e-7), key


def test_micro_batches_must_divide_the_minibatch():
  cfg = tiny.loop_config("fp32")
  cfg.rl.update(num_prompts=4, group_size=4, num_minibatches=2, micro_batches=3)
  with pytest.raises(ValueError, match=r"--config.rl.micro_batches=3: must be >= 1 and divide "
                                       r"the minibatch of 8"):
    schema.TRAIN.validate(cfg)
  cfg.rl.micro_batches = 0
  with pytest.raises(ValueError, match="rl.micro_batches=0"):
    schema.TRAIN.validate(cfg)
  cfg.rl.micro_batches = 8  # micro-batches of 1 row cannot split over 8 data shards
  cfg.mesh.shape = (-1, 1)
  with pytest.raises(ValueError, match="a micro-batch"):
    build(cfg)


def test_the_update_program_checks_finiteness_once_not_once_per_leaf():
  """Regression (docs/real_model.md, "The update's compile memory"): the skip of a non-finite
  update must read one computed flag. As a select per leaf on the flag, XLA rewrote the finite
  check into a chain of one scalar `and` per checked leaf and fused a copy of the chain into every
  leaf's select: ~leaves^2 instructions, which for SmolLM2's 30 layers took > 12 min and > 6 GB
  of host memory to compile. The compiled program may hold the chain a few times (XLA fuses it
  into the flag's few consumers: ~3.3 `and`s per checked leaf, linear in the depth), not once per
  leaf (the per-leaf selects: 17,988 `and`s = 117 per leaf at this size, growing with the depth).
  The checked leaves: the gradient, the new params and the new optimizer state."""
  cfg = tiny.loop_config("fp32")
  cfg.model.n_layers = 4
  cfg.rl.update(num_prompts=4, group_size=4, max_new_tokens=4, log_kl_ref=False)
  setup = build(cfg)
  params = init.param_shapes(setup.model_cfg)
  opt_state = jax.eval_shape(setup.tx.init, params)
  update = jax.jit(make_rl_update(make_logprob_fn(setup.model_cfg, setup.trainer_policy),
                                  setup.tx, setup.update_cfg))
  hlo = update.lower(params, opt_state, None, _batch(setup), jax.random.key(0)).compile().as_text()
  ands = len(re.findall(r"= pred\[\] and\(", hlo))
  checked = sum(jnp.issubdtype(x.dtype, jnp.inexact)
                for x in jax.tree.leaves((params, params, opt_state)))
  assert 0 < ands <= 8 * checked, (ands, checked)
