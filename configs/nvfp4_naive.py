"""NVFP4 without the fixes: every linear layer (but the LM head) in NVFP4.

Every precision knob is spelled out (meanings: lowrl.precision.KNOBS). To make a recipe, copy
this file, edit PRECISION (and its name) and run `--config=configs/my_recipe.py`;
`lowrl.precision.recipe("nvfp4_naive")` reads PRECISION from here. The rest of the run is
configs/base.py.
"""

PRECISION = {
    "name": "nvfp4_naive",  # label in the precision table and logs
    "format": "nvfp4",  # every linear layer (but the LM head) in NVFP4
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


def get_config():
  from configs import base  # here: lowrl.precision.recipe imports PRECISION alone
  return base.get_config(PRECISION)
