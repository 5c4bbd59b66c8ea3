"""The FP32 -> BF16 compute cast of the weights, rounded stochastically (optimizer.compute_cast_rounding).

With FP32 master weights and BF16 compute, every BF16 GEMM casts its FP32 kernel to BF16 inside
the forward, rounding to nearest (`x.astype(bfloat16)` in lowrl.quant.qdot). With
`compute_cast_rounding="stochastic"` the trainer's compute copy of those kernels is instead
`sr_cast_bf16(master, key)` (lowrl.quant.rounding: unbiased, each element one of its two BF16
neighbours), drawn afresh for every optimizer update, held as FP32 values on the BF16 grid so the
model's own cast is then exact and the program is otherwise the round-to-nearest one; the
update's gradient at the compute copy is applied to the master (straight through, as the nearest
cast's own gradient is).

What is cast: the kernels of the unquantized linear layers whose GEMM runs in BF16 (`cast_paths`).
Not: the embedding table (its lookup keeps the nearest cast; with tied embeddings it is also the
LM head, an FP32 GEMM), the FP32 LM head, norm scales and biases (applied in FP32), and the sampler,
the held-out evaluation and the reference, which keep the nearest cast: the knob is about the
training compute (the weights pi_old is scored with and the update's forward and backward run on);
the rollout engine and the evaluated policy are the master weights as an inference engine loads
them (rounded to nearest).

Keys: update i of an RL step casts with `update_key(step_update_key, i)`, a stream of the step's
update key that nothing else uses, so runs stay deterministic given the seed and a resume is exact
(the step key is fold_in(run key, step)); pi_old of the step is scored on update 0's compute copy.
"""
from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from lowrl.models import layout
from lowrl.models.config import ModelConfig
from lowrl.precision import PrecisionPolicy
from lowrl.quant.rounding import sr_cast_bf16

ROUNDINGS = ("nearest", "stochastic")
_STREAM = 0x5C0A57  # fold_in of the update key for the casts: a stream no other draw uses

ParamKeys = tuple[str, ...]


def check(rounding: str, master_dtype: str, policy_cfg: Any) -> None:
  """ValueError (one line, naming the fix) for a stochastic cast with nothing to cast.

  `policy_cfg`: the trainer's precision section (format, compute_dtype)."""
  if rounding not in ROUNDINGS:
    raise ValueError(f"--config.optimizer.compute_cast_rounding={rounding!r}; use one of "
                     f"{ROUNDINGS}.")
  if rounding == "nearest":
    return
  flag = "--config.optimizer.compute_cast_rounding=stochastic"
  if master_dtype != "float32":
    raise ValueError(f"{flag} rounds the cast of FP32 master weights, but "
                     f"optimizer.master_dtype={master_dtype!r} computes on the master itself (no "
                     "cast); set optimizer.master_dtype=float32, or use "
                     "optimizer.master_rounding=stochastic for BF16 master weights.")
  if policy_cfg.compute_dtype != "bfloat16":
    raise ValueError(f"{flag} rounds the FP32 -> BF16 cast, but precision.compute_dtype="
                     f"{policy_cfg.compute_dtype!r}; set --config.precision.compute_dtype=bfloat16"
                     " (e.g. --config=configs/base.py:bf16) or compute_cast_rounding=nearest.")
  if policy_cfg.format != "none":
    raise ValueError(f"{flag} rounds the BF16 cast of unquantized weights, but precision.format="
                     f"{policy_cfg.format!r} quantizes the FP32 weights directly; set "
                     "--config.precision.format=none or compute_cast_rounding=nearest.")


def cast_paths(model_cfg: ModelConfig, policy: PrecisionPolicy) -> tuple[ParamKeys, ...]:
  """The param keys of the kernels the forward casts to BF16: own kernels of unquantized
  matmuls whose GEMM dtype is bfloat16 (a tied head reads the embedding table: not one)."""
  out = []
  for m in layout.matmuls(model_cfg):
    q = policy.qdot_config(m.full_path)
    if m.owns_kernel and not q.quantized and q.compute_dtype == "bfloat16":
      out.append(m.param_keys)
  return tuple(out)


def update_key(step_key: jax.Array, i: int | jax.Array) -> jax.Array:
  """The cast key of optimizer update `i` of an RL step whose update key is `step_key`."""
  return jax.random.fold_in(jax.random.fold_in(step_key, _STREAM), i)


def stochastic_cast(params: Any, paths: tuple[ParamKeys, ...], key: jax.Array) -> Any:
  """`params` with the FP32 leaves at `paths` rounded stochastically onto the BF16 grid (kept
  FP32; leaf j with fold_in(key, j)). The update differentiates at the result: the gradient of
  the compute copy is the master's (the straight-through gradient of the cast, as for the
  nearest cast)."""
  if not paths:
    return params
  out = jax.tree.map(lambda x: x, params)  # a fresh container tree (dicts), same leaves

  def put(tree, keys, value):
    for k in keys[:-1]:
      tree = tree[k]
    tree[keys[-1]] = value

  for j, keys in enumerate(paths):
    w = layout.get_param(params, keys)
    if w.dtype != jnp.float32:
      raise ValueError(f"compute_cast_rounding=stochastic: {'/'.join(keys)} is {w.dtype}, not "
                       "FP32 master weights (optimizer.master_dtype=float32).")
    put(out, keys, sr_cast_bf16(w, jax.random.fold_in(key, j)).astype(jnp.float32))
  return out
