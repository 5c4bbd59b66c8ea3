"""W4A16: NVFP4 weights, activations in the compute dtype (weight-only quantization).

The rollout setting Miles, NeMo RL's QA-RL guide and verl's NVFP4 QAT recipe use: an inference
engine runs the linears as NVFP4 weights x BF16 activations (vLLM: ModelOpt `W4A16_NVFP4`,
Marlin FP4 kernels). Used as the sampler's recipe alone (`--config.sampler_precision.recipe=
nvfp4_w4a16`, trainer in BF16), or for both (`--config=configs/nvfp4_w4a16.py`): the trainer then
fake-quantizes its weights (QAT: the forward multiplies the dequantized NVFP4 weights, the
backward per `backward`), so sampler and trainer compute the same policy. Every precision knob is
spelled out (meanings: lowrl.precision.KNOBS); the rest of the run is configs/base.py.
"""

PRECISION = {
    "name": "nvfp4_w4a16",  # label in the precision table and logs
    "format": "nvfp4",  # weights of every linear layer (but the LM head) in NVFP4
    "act_format": "none",  # activations unquantized: weight-only (W4A16)
    "compute_dtype": "bfloat16",  # activations, attention, KV cache, the GEMMs' operand dtype
    "backward": "dequantized",  # dgrad through the dequantized weights (QAT), wgrad on BF16 x
    "grad_format": "",  # gradient quantizer when backward=quantized ('' = format)
    "act_per_token": False,  # (activations are not quantized)
    "four_over_six": False,  # standard NVFP4 weight scales (engines' quantizers)
    "weight_block_2d": False,  # NVFP4: 16x16 weight blocks
    "scale_rounding": "rceil",  # MX scales: rceil | floor
    "stochastic_rounding": "none",  # none | grad | all
    "rht_wgrad": False,  # random Hadamard transform on the wgrad GEMM (backward=quantized)
    "bf16_last_fraction": 0.0,  # every decoder layer quantized, as W4A16 rollouts run
    "quantize_lm_head": False,  # LM head unquantized
    "lm_head_dtype": "float32",  # GEMM dtype of the unquantized LM head
    "high_precision_paths": "",  # regex of further matmuls kept unquantized ('' = none)
    "gemm": "emulated",  # forward GEMMs: emulated (dequantized weights x BF16 activations)
    "weight_scales": "fused",  # q/k/v, gate/up: one per-tensor weight scale | per_linear
}


def get_config():
  from configs import base  # here: lowrl.precision.recipe imports PRECISION alone
  return base.get_config(PRECISION)
