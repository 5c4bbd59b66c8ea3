"""Quantization configs: which format, along which axis, with which options.

Both configs are frozen dataclasses so they are hashable: they travel as static arguments
of `jax.jit` and as non-differentiable arguments of `jax.custom_vjp`.
"""
from __future__ import annotations

import dataclasses

# Format name -> (default block size, kind). Block size None = one scale per tensor.
FORMATS: dict[str, tuple[int | None, str]] = {
    "fp8_e4m3": (None, "tensor"),
    "fp8_e5m2": (None, "tensor"),
    "mxfp8_e4m3": (32, "mx"),
    "mxfp8_e5m2": (32, "mx"),
    "mxfp4": (32, "mx"),
    "nvfp4": (16, "nvfp4"),
}
SCALE_ROUNDINGS = ("floor", "rceil")
FOUR_OVER_SIX_METRICS = ("mse", "mae")
SCALE_CONVENTIONS = ("exact", "te", "te_v2_13")
BACKWARD_MODES = ("high_precision", "dequantized", "quantized")
REQUANTIZE_SOURCES = ("original", "dequantized")
COMPUTE_DTYPES = ("float32", "bfloat16", "float16")
# How a quantized forward GEMM runs: "emulated" multiplies the dequantized operands in
# compute_dtype; "native" multiplies the FP8 codes (float8 dot operands, scales applied as XLA
# lowers to cuBLASLt FP8 GEMMs; MX block scales through lax.scaled_dot).
GEMMS = ("emulated", "native")
NATIVE_FORMATS = ("fp8_e4m3", "fp8_e5m2", "mxfp8_e4m3", "mxfp8_e5m2")


@dataclasses.dataclass(frozen=True)
class QuantConfig:
  """How to quantize one tensor.

  Attributes:
    fmt: one of FORMATS.
    axis: the axis blocks run along (the reduction axis of the matmul that consumes the tensor).
    block_size: elements per block; None means the format's default (32 for MX, 16 for NVFP4).
    scale_rounding: MX only. "floor" is the OCP v1.0 rule, "rceil" rounds the scale up
      (cuBLAS / TransformerEngine / JAX `scaled_dot_general`).
    per_token: NVFP4 only. One FP32 outer scale per row (every index of the non-block axes)
      instead of one per tensor.
    block_2d: NVFP4 only. 16x16 blocks over the last two axes, so W and W^T quantize identically.
    four_over_six: NVFP4 only. Per block, map the block max to 6 or to 4, whichever gives lower error;
      the outer-scale denominator uses 256 instead of 448.
    four_over_six_metric: "mse" or "mae", the error that selects between 6 and 4.
    stochastic_rounding: round elements stochastically (needs a PRNG key). NVFP4 then rounds its
      outer and block scales up (exactly) instead of to nearest, and MX needs rceil, so that no
      element saturates: SR is unbiased on every element.
    scale_convention: NVFP4 only. "exact": every quotient rounded once, to nearest even
      (docs/reference.md §2). "te": TransformerEngine's current FP32 arithmetic (v2.14 and later),
      bit for bit (te.py): per-tensor or per_token, 4/6 as TE's 4over6 chooses, round to
      nearest, 1-D blocks. "te_v2_13": TE v2.10-v2.13's block-scale order, per-tensor only.
  """

  fmt: str
  axis: int = -1
  block_size: int | None = None
  scale_rounding: str = "rceil"
  per_token: bool = False
  block_2d: bool = False
  four_over_six: bool = False
  four_over_six_metric: str = "mse"
  stochastic_rounding: bool = False
  scale_convention: str = "exact"

  def __post_init__(self):
    if self.fmt not in FORMATS:
      raise ValueError(f"Unknown quantization format {self.fmt!r}; use one of {sorted(FORMATS)}.")
    kind = FORMATS[self.fmt][1]
    if self.scale_rounding not in SCALE_ROUNDINGS:
      raise ValueError(
          f"scale_rounding={self.scale_rounding!r}; use one of {SCALE_ROUNDINGS}.")
    if self.four_over_six_metric not in FOUR_OVER_SIX_METRICS:
      raise ValueError(f"four_over_six_metric={self.four_over_six_metric!r}; "
                       f"use one of {FOUR_OVER_SIX_METRICS}.")
    if self.block_size is not None:
      if kind == "tensor":
        raise ValueError(f"{self.fmt} uses one per-tensor scale: leave block_size=None.")
      if self.block_size <= 0:
        raise ValueError(f"block_size must be positive, got {self.block_size}.")
    if kind != "nvfp4" and (self.per_token or self.block_2d or self.four_over_six):
      raise ValueError(f"per_token, block_2d and four_over_six are NVFP4 options; got fmt={self.fmt!r}.")
    if self.four_over_six and (self.block or 0) ** (2 if self.block_2d else 1) > 1024:
      raise ValueError("four_over_six sums per-block errors in int32 limbs: use blocks of at "
                       "most 1024 elements.")
    if kind == "mx" and self.stochastic_rounding and self.scale_rounding == "floor":
      raise ValueError(f"{self.fmt}: stochastic_rounding with scale_rounding='floor' saturates "
                       "block maxima above max_normal * 2**e (biased); use scale_rounding='rceil'.")
    if self.scale_convention not in SCALE_CONVENTIONS:
      raise ValueError(f"scale_convention={self.scale_convention!r}; use one of "
                       f"{SCALE_CONVENTIONS}.")
    if self.scale_convention != "exact" and (kind != "nvfp4" or self.stochastic_rounding
                                             or self.block_2d):
      raise ValueError(f"scale_convention={self.scale_convention!r} reproduces TransformerEngine's "
                       "round-to-nearest NVFP4 quantizer with 1-D blocks: use fmt='nvfp4' without "
                       "stochastic_rounding or block_2d (or scale_convention='exact').")
    if self.scale_convention == "te_v2_13" and (self.per_token or self.four_over_six):
      raise ValueError("scale_convention='te_v2_13': TE v2.13 had neither row-scaled NVFP4 nor "
                       "4over6; use scale_convention='te' for per_token or four_over_six.")
    if self.per_token and self.block_2d:
      raise ValueError("per_token and block_2d don't combine: 16x16 tiles span 16 rows, so one outer "
                       "scale per row is not defined; choose one.")

  @property
  def kind(self) -> str:
    """"tensor" (per-tensor FP8), "mx" or "nvfp4"."""
    return FORMATS[self.fmt][1]

  @property
  def scheme(self) -> str:
    """The scale arithmetic: kind, or "nvfp4_te" for NVFP4 with a TE scale_convention."""
    return "nvfp4_te" if self.scale_convention != "exact" else self.kind

  @property
  def block(self) -> int | None:
    """Effective block size (None for per-tensor formats)."""
    return self.block_size if self.block_size is not None else FORMATS[self.fmt][0]


@dataclasses.dataclass(frozen=True)
class QDotConfig:
  """How one matmul is quantized, forward and backward.

  Attributes:
    lhs: quantizer of the left operand (activations), None = not quantized.
    rhs: quantizer of the right operand (weights), None = not quantized.
    backward: "high_precision" (straight-through: gradients from the original operands),
      "dequantized" (backward GEMMs on the dequantized forward operands, in compute_dtype),
      "quantized" (the incoming gradient is quantized too, with `grad`).
    grad: quantizer of the incoming gradient when backward == "quantized".
    requantize_from: backward == "quantized" only: the operand tensor the backward GEMMs quantize
      along their own contracting axes. "original" (default) quantizes the original operand, as
      TransformerEngine quantizes its input column-wise for the transposed GEMMs: one quantization
      error. "dequantized" requantizes the dequantized forward operand, compounding the forward's
      error with a second one (the backward then sees values the forward saw, re-blocked).
    rht_wgrad: apply the random Hadamard transform to both weight-gradient operands
      (backward == "quantized" only).
    compute_dtype: dtype the GEMM operands are cast to after (de)quantization.
    gemm: the forward GEMM: "emulated" (dequantized operands in compute_dtype) or "native"
      (FP8 codes as float8 dot operands; both operands in NATIVE_FORMATS of one kind, per-tensor
      or MX with equal blocks). The backward is the same for both.
  """

  lhs: QuantConfig | None = None
  rhs: QuantConfig | None = None
  backward: str = "high_precision"
  grad: QuantConfig | None = None
  requantize_from: str = "original"
  rht_wgrad: bool = False
  compute_dtype: str = "float32"
  gemm: str = "emulated"

  def __post_init__(self):
    if self.gemm not in GEMMS:
      raise ValueError(f"gemm={self.gemm!r}; use one of {GEMMS}.")
    if self.gemm == "native":
      fmts = tuple(q.fmt if q is not None else None for q in (self.lhs, self.rhs))
      if (any(f not in NATIVE_FORMATS for f in fmts) or self.lhs.kind != self.rhs.kind
          or self.lhs.block != self.rhs.block):
        raise ValueError(f"gemm='native' multiplies FP8 codes: both operands need a format of "
                         f"{NATIVE_FORMATS}, both per-tensor or both MX with one block size; "
                         f"got lhs={fmts[0]}, rhs={fmts[1]}: use gemm='emulated'.")
    if self.backward not in BACKWARD_MODES:
      raise ValueError(f"backward={self.backward!r}; use one of {BACKWARD_MODES}.")
    if self.compute_dtype not in COMPUTE_DTYPES:
      raise ValueError(f"compute_dtype={self.compute_dtype!r}; use one of {COMPUTE_DTYPES}.")
    if self.backward == "quantized" and self.grad is None:
      raise ValueError("backward='quantized' needs a gradient quantizer: set grad=QuantConfig(...).")
    if self.requantize_from not in REQUANTIZE_SOURCES:
      raise ValueError(f"requantize_from={self.requantize_from!r}; use one of "
                       f"{REQUANTIZE_SOURCES}.")
    if self.rht_wgrad and self.backward != "quantized":
      raise ValueError("rht_wgrad only applies to backward='quantized'.")

  @property
  def quantized(self) -> bool:
    return self.lhs is not None or self.rhs is not None
