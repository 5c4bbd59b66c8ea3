r"""The named precision recipes, as data: a base recipe and how each other one differs from it.

A recipe is the `precision` section of a run (`lowrl.precision.KNOBS` gives every knob's meaning,
`lowrl.precision.make_policy` checks the values). `BF16` spells out every knob; every other recipe
names its parent and only the knobs it changes. Run one with `--config=configs/<name>.py` (or
`--config=configs/base.py:<name>`); as the sampler's alone with
`--config.sampler_precision.recipe=<name>`. A recipe of your own is a config file that changes
the knobs of a named one (docs/configuration.md):

  c = base.get_config("nvfp4_recipe"); c.precision.update(name="my_recipe", four_over_six=False)

This module imports nothing: the library (lowrl.precision.recipe) and the config files read it.
"""
from __future__ import annotations

from typing import Any

# BF16 compute, nothing quantized: the usual mixed-precision baseline and the base recipe.
BF16: dict[str, Any] = {
    "name": "bf16",  # label in the precision table and logs
    "format": "none",  # linear layers unquantized (or a lowrl.quant format: nvfp4, mxfp8_e4m3, ...)
    "act_format": "",  # activations: '' = quantized like the weights; 'none' = weight-only
    "compute_dtype": "bfloat16",  # activations, attention, KV cache, unquantized GEMMs
    "backward": "high_precision",  # high_precision | dequantized | quantized
    "grad_format": "",  # gradient quantizer when backward=quantized ('' = format)
    "act_per_token": False,  # NVFP4: one FP32 outer scale per token for activations
    "four_over_six": False,  # NVFP4: 4/6 block scaling
    "weight_block_2d": False,  # NVFP4: 16x16 weight blocks
    "scale_rounding": "rceil",  # MX scales: rceil | floor
    "stochastic_rounding": "none",  # none | grad | all
    "rht_wgrad": False,  # random Hadamard transform on the wgrad GEMM (backward=quantized)
    "bf16_last_fraction": 0.0,  # no unquantized tail layers
    "quantize_lm_head": False,  # LM head unquantized
    "lm_head_dtype": "float32",  # GEMM dtype of the unquantized LM head
    "high_precision_paths": "",  # regex of further matmuls kept unquantized ('' = none)
    "gemm": "emulated",  # forward GEMMs: emulated | native (FP8 formats: float8 GEMM operands)
    "weight_scales": "fused",  # q/k/v, gate/up: one per-tensor weight scale | per_linear
}


def derive(parent: dict[str, Any], name: str, **changes: Any) -> dict[str, Any]:
  """Recipe `name`: `parent` with `changes` (knobs of the parent only)."""
  unknown = sorted(set(changes) - set(parent))
  if unknown:
    raise ValueError(f"recipe {name!r}: unknown precision knobs {unknown}; the knobs are "
                     f"{list(parent)}.")
  return {**parent, **changes, "name": name}


# FP32 everywhere: the unquantized reference.
FP32 = derive(BF16, "fp32", compute_dtype="float32")

# FP16 compute, nothing quantized (needs a static loss scale: --config.optimizer.loss_scale).
FP16 = derive(BF16, "fp16", compute_dtype="float16")

# MXFP8 (arXiv 2506.08027): E4M3 everywhere (but the LM head), block scales rounded up (rceil).
# Its E4M3 gradients are one flag away: --config.precision.backward=quantized.
MXFP8 = derive(BF16, "mxfp8", format="mxfp8_e4m3")

# NVFP4 without the fixes: every linear layer (but the LM head) in NVFP4.
NVFP4_NAIVE = derive(BF16, "nvfp4_naive", format="nvfp4")

# NVFP4 with the 4-bitter lesson's fixes (docs/reference.md section 1): the main job.
NVFP4_RECIPE = derive(
    NVFP4_NAIVE, "nvfp4_recipe",
    backward="dequantized",  # gradients through the dequantized operands
    act_per_token=True,  # one FP32 outer scale per token for activations
    four_over_six=True,  # 4/6 block scaling
    bf16_last_fraction=0.15,  # the last 15% of the layers (at least one) unquantized
)

# NVFP4 on the routed experts only, everything else BF16: the MoE ports' 4-bitter scope.
# Miles, NeMo RL, verl and SkyRL run NVFP4 W4A4 on the routed-expert GEMMs with per-token
# activation scales and keep attention, routers, shared experts, embeddings and the LM head in
# BF16. So here the routers (lowrl.precision.ROUTER) run BF16 GEMMs, being outside the experts;
# for an FP32 router exclude them from high_precision_paths too,
# `(?!layers_\d+/mlp/(experts/|router$|shared_expert_gate$)|lm_head$).*`; make_policy gives them
# FP32. They are never quantized unless a rule asks (lowrl.precision.prepend_rules). On a dense
# model nothing is quantized.
NVFP4_MOE_EXPERTS = derive(
    NVFP4_RECIPE, "nvfp4_moe_experts",
    bf16_last_fraction=0.0,  # every layer's routed experts quantized
    # Everything but the routed experts (lowrl.precision.ROUTED_EXPERTS) unquantized (BF16).
    high_precision_paths=r"(?!layers_\d+/mlp/experts/|lm_head$).*",
)

# W4A16: NVFP4 weights, activations in the compute dtype (weight-only quantization). The rollout
# setting Miles, NeMo RL's QA-RL guide and verl's NVFP4 QAT recipe use: an inference engine runs
# the linears as NVFP4 weights x BF16 activations (vLLM: ModelOpt `W4A16_NVFP4`, Marlin FP4
# kernels). As the sampler's recipe alone (`--config.sampler_precision.recipe=nvfp4_w4a16`,
# trainer in BF16), or for both (`--config=configs/nvfp4_w4a16.py`): the trainer then
# fake-quantizes its weights (QAT: the forward multiplies the dequantized NVFP4 weights), so
# sampler and trainer compute the same policy.
NVFP4_W4A16 = derive(
    NVFP4_NAIVE, "nvfp4_w4a16",
    act_format="none",  # activations unquantized: weight-only (W4A16)
    backward="dequantized",  # dgrad through the dequantized weights (QAT), wgrad on BF16 x
)

# Every named recipe, in the order the precision tables list them.
RECIPES: dict[str, dict[str, Any]] = {
    r["name"]: r for r in (FP32, BF16, FP16, MXFP8, NVFP4_NAIVE, NVFP4_RECIPE, NVFP4_MOE_EXPERTS,
                           NVFP4_W4A16)}
