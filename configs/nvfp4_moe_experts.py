r"""NVFP4 on the routed experts only, everything else BF16: the MoE ports' 4-bitter scope.

Miles, NeMo RL, verl and SkyRL run NVFP4 W4A4 on the routed-expert GEMMs with per-token
activation scales and keep attention, routers, shared experts, embeddings and the LM head in
BF16. So here: the routers (lowrl.precision.ROUTER) run BF16 GEMMs, being outside the experts;
for an FP32 router exclude them from high_precision_paths too,
`(?!layers_\d+/mlp/(experts/|router$|shared_expert_gate$)|lm_head$).*`; make_policy gives them FP32.
They are never quantized unless a rule asks (lowrl.precision.prepend_rules). On a dense model
nothing is quantized. Every knob spelled out, as in configs/nvfp4_recipe.py.
"""

PRECISION = {
    "name": "nvfp4_moe_experts",  # label in the precision table and logs
    "format": "nvfp4",  # the routed experts (every path high_precision_paths leaves) in NVFP4
    "act_format": "",  # activations in the weight format (W4A4); "none" = weight-only
    "compute_dtype": "bfloat16",  # activations, attention, KV cache, unquantized GEMMs
    "backward": "dequantized",  # gradients through the dequantized operands
    "grad_format": "",  # gradient quantizer when backward=quantized ('' = format)
    "act_per_token": True,  # one FP32 outer scale per token for activations
    "four_over_six": True,  # 4/6 block scaling
    "weight_block_2d": False,  # NVFP4: 16x16 weight blocks
    "scale_rounding": "rceil",  # MX scales: rceil | floor
    "stochastic_rounding": "none",  # none | grad | all
    "rht_wgrad": False,  # random Hadamard transform on the wgrad GEMM (backward=quantized)
    "bf16_last_fraction": 0.0,  # every layer's routed experts quantized
    "quantize_lm_head": False,  # LM head unquantized
    "lm_head_dtype": "float32",  # GEMM dtype of the unquantized LM head
    # Everything but the routed experts (lowrl.precision.ROUTED_EXPERTS) unquantized (BF16).
    "high_precision_paths": r"(?!layers_\d+/mlp/experts/|lm_head$).*",
    "gemm": "emulated",  # forward GEMMs: emulated | native (FP8 formats: float8 GEMM operands)
    "weight_scales": "fused",  # q/k/v, gate/up: one per-tensor weight scale | per_linear
}


def get_config():
  from configs import base  # here: lowrl.precision.recipe imports PRECISION alone
  return base.get_config(PRECISION)
