"""The RL step of a LoRA run: the adapters trained, the base frozen (`lowrl.models.lora`).

The loop's params stay one combined tree (base + adapters next to their kernels), so the sampler,
the evaluation, the calibration and the refit check read the adapters as they read any weight.
The step splits it: the update (`step.make_step`, unchanged) differentiates and updates the
adapter tree alone, with the base closed over as an input of the same program. Its gradient is
therefore never formed (no weight-gradient GEMM of a base matmul, no base-sized gradient or
optimizer state); only the input gradient flows through each base matmul, in the recipe's
backward mode. The base comes out as it went in (the donated input buffer).

Choices a frozen base rules out are config errors (`check_config`): the gradient probes and the
stochastic compute cast work on the full tree, the weight-gradient RHT on a GEMM that never runs.
"""
from __future__ import annotations

from typing import Any

import ml_collections
import optax

import jax

from lowrl.models import init, layout, lora
from lowrl.models.config import ModelConfig
from lowrl.precision import PrecisionPolicy
from lowrl.sampling import weights
from lowrl.sharding import ShardingPlan
from lowrl.training import optimizer
from lowrl.training.rl_update import UpdateConfig
from lowrl.training.step import BatchConfig, Step, make_step


def trainable(params: Any) -> Any:
  """The part of a combined tree the optimizer sees: its adapters."""
  return lora.split(params)[1]


def init_opt_state(tx: optax.GradientTransformation, params: Any) -> optax.OptState:
  """Optimizer state of the adapters only (FP32; the base has none)."""
  return optimizer.init_opt_state(tx, trainable(params))


def make_lora_step(logprob_fn, tx: optax.GradientTransformation, update_cfg: UpdateConfig,
                   batch_cfg: BatchConfig, plan: ShardingPlan | None = None) -> Step:
  """`step(params, opt_state, ref_params, rollout, key)` as `step.make_step`'s, over combined
  trees, updating their adapters only; `opt_state` is `init_opt_state`'s. A reference tree
  contributes its adapters (its base is the frozen one)."""

  def step(params, opt_state, ref_params, rollout, key):
    base, adapters = lora.split(params)
    ref_adapters = None if ref_params is None else lora.split(ref_params)[1]

    def frozen_base_logprobs(a, batch, quant_key):
      return logprob_fn(lora.merge(base, a), batch, quant_key)

    inner = make_step(frozen_base_logprobs, tx, update_cfg, batch_cfg, plan)
    adapters, opt_state, metrics = inner(adapters, opt_state, ref_adapters, rollout, key)
    return lora.merge(base, adapters), opt_state, metrics

  return step


def pack_base(params: Any, model_cfg: ModelConfig, policy: PrecisionPolicy) -> Any:
  """A combined tree with its base's quantized kernels packed (`sampling.weights.pack_params`:
  E2M1 codes two per byte + block and outer scales), its adapters and every other leaf as they
  are; a tree already packed comes back as it is. Done once, at load: the packed leaves are then
  the base (no master copy, no optimizer state). The forward dequantizes each kernel inside its
  layer and skips its weight quantizer (`blocks.QDense`), which is what the sampler computes
  from the same packed tree (`weights.dequantize_packed`): exact mode holds bit for bit."""
  base, adapters = lora.split(params)
  return lora.merge(weights.pack_params(base, model_cfg, policy), adapters)


def packed_base_bytes(model_cfg: ModelConfig, policy: PrecisionPolicy, master_dtype: str
                      ) -> float:
  """Bytes per parameter of the block linears of a base `pack_base` holds (codes and scales of
  the kernels the policy quantizes, the others in `master_dtype`): `memory.estimate`'s
  packed_base_bytes, from the packed tree's own shapes."""
  shapes = jax.eval_shape(lambda p: optimizer.to_master(p, master_dtype),
                          init.param_shapes(model_cfg))
  packed = jax.eval_shape(lambda p: weights.pack_params(p, model_cfg, policy), shapes)
  held = n = 0
  for m in layout.matmuls(model_cfg):
    if m.owns_kernel and m.layer is not None:  # the block linears (not the head)
      held += sum(x.size * x.dtype.itemsize
                  for x in jax.tree.leaves(layout.get_param(packed, m.param_keys)))
      n += layout.get_param(shapes, m.param_keys).size
  return held / n


def check_packed_base(cfg: ml_collections.ConfigDict, lora_cfg: lora.LoraConfig | None,
                      model_cfg: ModelConfig, policy: PrecisionPolicy) -> None:
  """One-line errors for `--config.lora.packed_base` where it cannot apply."""
  if lora_cfg is None:
    raise ValueError("--config.lora.packed_base packs a frozen LoRA base, but lora.rank=0 "
                     "trains every weight; set --config.lora.rank > 0 or packed_base=False.")
  if cfg.precision.backward != "dequantized":
    raise ValueError(f"--config.lora.packed_base: precision.backward={cfg.precision.backward!r} "
                     "needs the original weights, and a packed base holds only their quantized "
                     "codes; set --config.precision.backward=dequantized or packed_base=False.")
  try:
    weights.check_packable(model_cfg, policy)
  except ValueError as e:
    raise ValueError(f"--config.lora.packed_base: {e}") from None
  if not weights.prequantizable(policy, model_cfg):
    raise ValueError("--config.lora.packed_base: the recipe quantizes no weight, so there is "
                     "nothing to pack; use a 4-bit recipe (e.g. nvfp4_recipe) or "
                     "packed_base=False.")


def check_config(cfg: ml_collections.ConfigDict) -> None:
  """One-line errors for knobs that cannot apply to a frozen base (lora.rank > 0)."""
  if cfg.precision.rht_wgrad:
    raise ValueError("--config.precision.rht_wgrad transforms the weight-gradient GEMM, which a "
                     "frozen LoRA base never runs (the adapters' gradients are unquantized); set "
                     "--config.precision.rht_wgrad=False or --config.lora.rank=0.")
  if cfg.diagnostics.every:
    raise ValueError("--config.diagnostics.every probes the full model's gradient, which a LoRA "
                     "run never forms; set --config.diagnostics.every=0 or --config.lora.rank=0.")
  if cfg.optimizer.compute_cast_rounding == "stochastic":
    raise ValueError("--config.optimizer.compute_cast_rounding=stochastic re-rounds the master "
                     "weights every update, but a LoRA base is frozen; set it to nearest or "
                     "--config.lora.rank=0.")
