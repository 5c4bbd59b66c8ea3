"""FP32 everywhere: the unquantized reference.

Every precision knob is spelled out (meanings: lowrl.precision.KNOBS). To make a recipe, copy
this file, edit PRECISION (and its name) and run `--config=configs/my_recipe.py`;
`lowrl.precision.recipe("fp32")` reads PRECISION from here. The rest of the run is
configs/base.py.
"""

PRECISION = {
    "name": "fp32",  # label in the precision table and logs
    "format": "none",  # linear layers unquantized (or a lowrl.quant format: nvfp4, mxfp8_e4m3, ...)
    "act_format": "",  # activations: '' = quantized like the weights; 'none' = weight-only
    "compute_dtype": "float32",  # activations, attention, KV cache and GEMMs in FP32
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
