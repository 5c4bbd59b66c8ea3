"""Gradient-bias and update-erasure probes of the RL step (logged every `diagnostics.every` steps).

Both are measured on the step's own batch, at the parameters and optimizer state the step starts
from, in programs of their own (`Trainer.probe` jits `make_grad_fn` twice, `grad_agreement` and
`make_erasure_fn`): the training step's program and numbers are untouched.

Gradient bias: the gradient of the RL loss on the whole batch (one minibatch, one pass; pi_old
recomputed in each gradient's own precision, so the PPO ratio is 1 and the gradient is the
policy-gradient estimate A * grad log pi, plus the KL term when kl_coef > 0) under the run's
trainer recipe, against the same gradient with FP32 parameters and an unquantized FP32 policy.
Per top-level parameter group (`layers_{i}`, `embed`, `final_norm`, `lm_head`) and in total:
  cos      = <g, g32> / (|g| |g32|)
  rel_err  = |g - g32| / |g32|
  norm_ratio = |g| / |g32|
Update erasure: one optimizer step from the current state on the recipe's gradient, computed in
FP32 (`optimizer.apply_update` on FP32 parameters) and in the master dtype (the run's rounding,
nearest or stochastic): the fraction of the entries the FP32 step moves that the master-dtype step
leaves unchanged, i.e. rounded away (0 for FP32 master weights by definition).
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
import jax.numpy as jnp
import optax

from lowrl.training.optimizer import apply_update, to_master
from lowrl.training.rl_update import UpdateConfig, make_rl_update
from lowrl.training.step import BatchConfig, Rollout, make_batch


def _sq(tree: Any) -> jax.Array:
  return sum((jnp.sum(jnp.square(x.astype(jnp.float32))) for x in jax.tree.leaves(tree)),
             jnp.zeros((), jnp.float32))


def _dot(a: Any, b: Any) -> jax.Array:
  return sum((jnp.sum(x.astype(jnp.float32) * y.astype(jnp.float32))
              for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b))), jnp.zeros((), jnp.float32))


def _agreement(g: Any, g_ref: Any) -> dict[str, jax.Array]:
  """cos, rel_err, norm_ratio of one group (see the module docstring); FP32. Zero norms give
  cos 1 when both are zero (else 0), and rel_err / norm_ratio 0 when the reference is zero."""
  n, n_ref = jnp.sqrt(_sq(g)), jnp.sqrt(_sq(g_ref))
  diff = jax.tree.map(lambda x, y: x.astype(jnp.float32) - y.astype(jnp.float32), g, g_ref)
  denom = n * n_ref
  both_zero = (n == 0) & (n_ref == 0)
  cos = jnp.where(denom > 0, _dot(g, g_ref) / jnp.where(denom > 0, denom, 1.0),
                  jnp.where(both_zero, 1.0, 0.0))
  safe_ref = jnp.where(n_ref > 0, n_ref, 1.0)
  return {"cos": cos,
          "rel_err": jnp.where(n_ref > 0, jnp.sqrt(_sq(diff)) / safe_ref, 0.0),
          "norm_ratio": jnp.where(n_ref > 0, n / safe_ref, 0.0)}


def grad_agreement(grads: dict[str, Any], ref_grads: dict[str, Any]) -> dict[str, jax.Array]:
  """`grad_bias/<metric>/<group>` for every top-level key of the gradient trees and
  `grad_bias/<metric>/total` over all of them (metrics: cos, rel_err, norm_ratio)."""
  out = {}
  for group in sorted(grads):
    for k, v in _agreement(grads[group], ref_grads[group]).items():
      out[f"grad_bias/{k}/{group}"] = v
  for k, v in _agreement(grads, ref_grads).items():
    out[f"grad_bias/{k}/total"] = v
  return out


def update_erasure(old: Any, new_master: Any, new32: Any) -> jax.Array:
  """Fraction of the entries that the FP32 step moves (new32 != old) which the master-dtype step
  leaves unchanged (new_master == old); 0 when the FP32 step moves nothing."""
  moved = erased = jnp.zeros((), jnp.float32)
  for o, m, n in zip(jax.tree.leaves(old), jax.tree.leaves(new_master), jax.tree.leaves(new32)):
    o32 = o.astype(jnp.float32)
    moves = n.astype(jnp.float32) != o32
    moved += jnp.sum(moves.astype(jnp.float32))
    erased += jnp.sum((moves & (m.astype(jnp.float32) == o32)).astype(jnp.float32))
  return jnp.where(moved > 0, erased / jnp.maximum(moved, 1.0), 0.0)


def _capture_grads() -> optax.GradientTransformation:
  """A 'transformation' whose state after `update` is the incoming (FP32) gradient and whose
  updates are zero: running the RL update with it returns the update's gradient."""
  def init(params):
    return jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params)

  def update(grads, state, params=None):
    del state, params
    return jax.tree.map(jnp.zeros_like, grads), grads
  return optax.GradientTransformation(init, update)


def make_grad_fn(logprob_fn, update_cfg: UpdateConfig, batch_cfg: BatchConfig, *,
                 param_dtype: str | None = None
                 ) -> Callable[[Any, Any, Rollout, jax.Array], Any]:
  """`grad(params, ref_params, rollout, key) -> FP32 gradient tree` of the RL loss on the whole
  rollout (one minibatch, one pass, pi_old recomputed in this precision); pure and jittable.

  The gradient comes from the update itself (`make_rl_update` with an optimizer that keeps the
  gradient as its state), so it is of exactly the loss the step trains. `param_dtype`: params
  and ref_params are cast to it first (e.g. "float32" for the FP32 reference gradient).
  """
  one = dataclasses.replace(update_cfg, mu=1, num_minibatches=1, master_rounding="nearest")
  capture = _capture_grads()
  update = make_rl_update(logprob_fn, capture, one)

  def grad(params, ref_params, rollout: Rollout, key: jax.Array):
    if param_dtype is not None:
      params = to_master(params, param_dtype)
      ref_params = None if ref_params is None else to_master(ref_params, param_dtype)
    batch, _ = make_batch(rollout.out, rollout.rewards_B, batch_cfg)  # pi_old recomputed
    _, grads, _ = update(params, capture.init(params), ref_params, batch, key)
    return grads

  return grad


def make_erasure_fn(tx: optax.GradientTransformation, master_rounding: str
                    ) -> Callable[[Any, Any, Any, jax.Array], jax.Array]:
  """`erasure(params, grads, opt_state, key) -> update_erasure` of one `tx` step from
  `opt_state` on `grads`: the step in FP32 vs in the params' dtype with `master_rounding`."""
  def erasure(params, grads, opt_state, key):
    new32, _ = apply_update(tx, to_master(params, "float32"), grads, opt_state,
                            master_rounding="nearest", key=None)
    new_m, _ = apply_update(tx, params, grads, opt_state, master_rounding=master_rounding, key=key)
    return update_erasure(params, new_m, new32)
  return erasure
