"""Optimizer (optax) and master-weight handling.

Master weights are FP32 by default. With `master_dtype="bfloat16"` the parameter tree itself is
BF16: the update is computed in FP32 on the upcast weights and rounded back either to nearest
(RL's small updates below half a BF16 ulp are then erased) or stochastically (unbiased, so small
updates survive in expectation; docs/reference.md §2 "Stochastic rounding").
"""
from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import optax

from lowrl.quant.packing import PackedWeight
from lowrl.quant.rounding import sr_cast_bf16

# The choices of the optimizer knobs (their table: lowrl.training.schema.OPTIMIZER).
MASTER_DTYPES = ("float32", "bfloat16")
MASTER_ROUNDINGS = ("nearest", "stochastic")
SCHEDULES = ("constant", "cosine", "linear")


def tree_all_finite(tree: Any) -> jax.Array:
  """Scalar bool: every floating-point leaf of `tree` is finite (integer leaves, e.g. Adam's step
  count, are skipped)."""
  leaves = [jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(tree)
            if jnp.issubdtype(x.dtype, jnp.inexact)]
  return jnp.all(jnp.stack(leaves)) if leaves else jnp.array(True)


def make_schedule(cfg: ml_collections.ConfigDict, total_steps: int) -> optax.Schedule:
  """Learning-rate schedule: linear warmup then constant, cosine or linear decay."""
  warmup = min(cfg.warmup_steps, max(total_steps - 1, 0))
  decay_steps = max(total_steps - warmup, 1)
  if cfg.schedule == "constant":
    decay = optax.constant_schedule(cfg.lr)
  elif cfg.schedule == "cosine":
    decay = optax.cosine_decay_schedule(cfg.lr, decay_steps, alpha=cfg.get("final_lr_fraction", 0.0))
  else:
    decay = optax.linear_schedule(cfg.lr, cfg.lr * cfg.get("final_lr_fraction", 0.0), decay_steps)
  if warmup == 0:
    return decay
  return optax.join_schedules([optax.linear_schedule(0.0, cfg.lr, warmup), decay], [warmup])


def make_optimizer(cfg: ml_collections.ConfigDict, total_steps: int) -> optax.GradientTransformation:
  """AdamW with optional global-norm clipping; state is always FP32.

  `cfg` is a validated optimizer section (lowrl.training.schema.OPTIMIZER: knobs, defaults, checks).
  """
  parts = []
  if cfg.grad_clip is not None:
    parts.append(optax.clip_by_global_norm(cfg.grad_clip))
  parts.append(optax.adamw(make_schedule(cfg, total_steps), b1=cfg.b1, b2=cfg.b2, eps=cfg.eps,
                           weight_decay=cfg.weight_decay))
  return optax.chain(*parts)


def to_master(params: Any, master_dtype: str) -> Any:
  """Casts a parameter tree to the master-weight dtype (floating leaves only)."""
  dtype = jnp.dtype(master_dtype)
  # A packed (frozen LoRA) base keeps its codes and scales: casting its FP8 scales would change
  # the weights it holds.
  return jax.tree.map(
      lambda p: p if isinstance(p, PackedWeight) or not jnp.issubdtype(p.dtype, jnp.floating)
      else p.astype(dtype), params, is_leaf=lambda p: isinstance(p, PackedWeight))


def init_opt_state(tx: optax.GradientTransformation, params: Any) -> optax.OptState:
  """Optimizer state, in FP32 whatever the master dtype."""
  return tx.init(to_master(params, "float32"))


def apply_update(tx: optax.GradientTransformation, params: Any, grads: Any,
                 opt_state: optax.OptState, *, master_rounding: str,
                 key: jax.Array | None, step_scale: jax.Array | None = None
                 ) -> tuple[Any, optax.OptState]:
  """One optimizer step: FP32 arithmetic, result rounded back to each leaf's dtype.

  `step_scale` (a scalar) multiplies the update, i.e. the learning rate of this step (the
  optimizer's moments see the unscaled gradient): VCPO's ESS-scaled step.

  FP32 leaves are returned exactly as optax computes them. BF16 leaves are rounded to nearest or
  stochastically (`master_rounding`), the latter with a key folded per leaf.
  """
  params32 = to_master(params, "float32")
  grads32 = to_master(grads, "float32")
  updates, opt_state = tx.update(grads32, opt_state, params32)
  if step_scale is not None:
    updates = jax.tree.map(lambda u: u * step_scale, updates)
  new32 = optax.apply_updates(params32, updates)

  leaves, treedef = jax.tree.flatten(params)
  new_leaves = treedef.flatten_up_to(new32)
  out = []
  for i, (old, new) in enumerate(zip(leaves, new_leaves)):
    if old.dtype == jnp.float32:
      out.append(new)
    elif old.dtype == jnp.bfloat16 and master_rounding == "stochastic":
      if key is None:
        raise ValueError("master_rounding='stochastic' needs a PRNG key.")
      out.append(sr_cast_bf16(new, jax.random.fold_in(key, i)))
    else:
      out.append(new.astype(old.dtype))
  return jax.tree.unflatten(treedef, out), opt_state
