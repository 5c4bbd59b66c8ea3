"""quantize / dequantize / fake_quant for every format: per-tensor FP8, MX (MXFP8, MXFP4), NVFP4.

All formats share one pipeline, written once in FP32 on a *blocked view* of the input (the block
axis split into (n_blocks, block) so block reductions are plain keepdims reductions; layout.py;
spec-exact NVFP4 in nvfp4.py):

  amax per block -> scale(s) -> elements y = x * fl(1/scale) -> saturate + round onto the element
  grid -> dequantized = grid * scale (NVFP4 rounds the exact quotients instead, below).

Scale formulas (FP32; fl(.) = rounded to FP32). They are written so that XLA's algebraic rewrites
(division by a constant or a broadcast -> multiplication by the reciprocal; reassociating products
with broadcast operands) leave them unchanged, so jitted and eager results are bit-identical:
  per-tensor FP8  s = amax * fl(1/max_normal); y = x * fl(1/s); dq = code * s.
  MX              s = 2**e (E8M0), e by the floor or rceil rule; y = x * 2**-e; dq = code * 2**e
                  (both exact).
  NVFP4           spec-exact (docs/reference.md §2; every rounding one RNE of the exact value, see
                  exact.py): s_outer = RNE_f32(amax / (6*448)) (6*256 with four_over_six);
                  s_block = RNE_e4m3(amax_block / (6 * s_outer)); code = RNE_e2m1(x / (s_block *
                  s_outer)); dq = RNE_dtype(code * s_block * s_outer), one rounding of the exact
                  product to the output dtype (FP32: fl(code * s_block) * s_outer, the first
                  product exact; BF16/FP16: from that by round to odd, exact.narrow_product).
                  Stochastic rounding rounds both scales up instead (exact ceilings, so no
                  element saturates) and draws from the quotient x * fl(1/fl(s_block*s_outer)).
                  4/6 keeps 4 iff the exact squared (mse) or absolute (mae) error sum of its
                  exact dequantized values code * s_block * s_outer is strictly smaller
                  (four_over_six.py; a tie keeps 6), whatever the output dtype.
  NVFP4 "te"      TransformerEngine's FP32 arithmetic (te.py).

`quantize` stores the grid values in their ml_dtypes type and the scales in theirs (E8M0, E4M3,
FP32); `fake_quant` skips the storage casts and applies the same scales to the FP32 grid values, so
`fake_quant(x) == dequantize(quantize(x)).astype(x.dtype)` bit for bit.

Special values (docs/reference.md §2):
  * MX: NaN/Inf in a block -> E8M0 scale NaN -> the whole block dequantizes to NaN; an all-zero
    block gets the smallest scale 2**-127 and stays exactly 0.
  * Per-tensor FP8 and NVFP4: the scale is taken from the amax of the tensor (of the row for
    per_token), so NaN/Inf anywhere in it makes the FP32 scale NaN and the tensor (row) NaN;
    an all-zero tensor (row) has scale 0 and dequantizes to exactly 0.
  * NVFP4 block scales are E4M3: they saturate at 448 and flush to 0 below 2**-10 (half the smallest
    E4M3 subnormal), in which case the block dequantizes to 0.
  * XLA on CPU flushes FP32 subnormals to zero (inputs and results of float arithmetic). MX
    handles them exactly anyway (scales and dequantization are exponent/bit arithmetic, subnormal
    inputs are scaled from their integer mantissa): an FP32 input 1.14e-38 dequantizes to 2**-126
    under mxfp8_e4m3, and FP32 outputs below 2**-126 are FP32 subnormals (a BF16 output goes
    through XLA's conversion, which may flush them). Per-tensor FP8 and NVFP4 read subnormal
    inputs as (signed) 0, flush dequantized values below 2**-126 to 0, and quantize tensors with
    amax below ~2**-115 (subnormal FP32 scale) to 0; the exact NVFP4 reference
    (tests/quant_reference.py) models the same flush.
  * `tensor_amax` (quantize / fake_quant keyword) replaces the data's amax in the per-tensor scale
    of fp8_e4m3 / fp8_e5m2 / nvfp4 (not per_token): a static, calibrated scale. Elements beyond it
    saturate (at amax; at 1.75 amax for nvfp4 four_over_six, whose outer scale leaves headroom),
    Inf elements saturate too, NaN elements make their block (NVFP4) or themselves (FP8) NaN.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import struct
from jax import lax

from lowrl.quant import formats, nvfp4, te
from lowrl.quant.config import QuantConfig
from lowrl.quant.formats import E4M3, ElementFormat
from lowrl.quant.layout import (Layout, abs_max, block_layout, check_tensor_amax, inv_const,
                                normalize_config, recip, squeeze, static_amax, unsqueeze)
from lowrl.quant.nvfp4 import with_sign_of
from lowrl.quant.rounding import f32_exponent, pow2, round_to_grid, stochastic_round_to_grid


@struct.dataclass
class QTensor:
  """A quantized tensor (a pytree: arrays are leaves, the config is static).

  Attributes:
    codes: element codes in their ml_dtypes type (float8_e4m3fn / float8_e5m2 / float4_e2m1fn),
      same shape as the input.
    scale: per-tensor FP8: FP32 scalar. MX: float8_e8m0fnu block scales, NVFP4: float8_e4m3fn block
      scales; block scales have the input's shape with the block axis divided by the block size
      (both of the last two axes for NVFP4 block_2d).
    outer: NVFP4 only: FP32 outer scale, shape () per tensor, or the input's shape with the block
      axis set to 1 for per_token (scale_convention="te": the FP32 tensor amax, which TE's
      dequantization reads). None for the other formats.
    cfg: the QuantConfig used, with `axis` normalized to a non-negative index.
  """

  codes: jax.Array
  scale: jax.Array
  outer: jax.Array | None
  cfg: QuantConfig = struct.field(pytree_node=False)


def _check(x: jax.Array, cfg: QuantConfig, key: jax.Array | None) -> tuple[QuantConfig, Layout]:
  if not isinstance(cfg, QuantConfig):
    raise ValueError(f"Expected a QuantConfig, got {type(cfg).__name__}.")
  if not jnp.issubdtype(x.dtype, jnp.floating):
    raise ValueError(f"Quantizers take floating-point input, got dtype {x.dtype}.")
  if cfg.stochastic_rounding and key is None:
    raise ValueError(f"{cfg.fmt} with stochastic_rounding=True needs a PRNG key: pass "
                     "key=jax.random.key(seed) (or set stochastic_rounding=False).")
  cfg = normalize_config(cfg, x.ndim)
  return cfg, block_layout(tuple(x.shape), cfg)




def _round(y_f32: jax.Array, fmt: ElementFormat, cfg: QuantConfig, key) -> jax.Array:
  if cfg.stochastic_rounding:
    return stochastic_round_to_grid(y_f32, fmt, key)
  return round_to_grid(y_f32, fmt)




# ---------------------------------------------------------------------------------------------
# Per format: stored scales from the blocked FP32 input, and dequantization from the stored
# scales. quantize, dequantize and fake_quant all go through the same functions.


def _tensor_scales(x_b: jax.Array, cfg: QuantConfig, fmt: ElementFormat, layout: Layout,
                   tensor_amax: jax.Array | None):
  if tensor_amax is None:
    amax = abs_max(x_b, None, keepdims=False)
  else:
    amax = static_amax(tensor_amax)
  scale = jnp.where(jnp.isfinite(amax), amax * inv_const(fmt.max_normal), jnp.nan)
  return scale, None


def _tensor_params(scale, outer, layout, cfg):
  """(encode multiplier, decode scale) of a per-tensor FP8 scale."""
  del outer, layout, cfg
  return recip(scale), scale


def _tensor_apply(grid_b, scale, dtype):
  return (grid_b * scale).astype(dtype)


def _mx_shared_exp(amax_b: jax.Array, cfg: QuantConfig, fmt: ElementFormat) -> jax.Array:
  """E8M0 exponent per block (int32, in [-127, 127]).

  floor (OCP v1.0): floor(log2 amax) - emax_elem. rceil: the smallest e with amax / 2**e <=
  max_normal, i.e. 2**ceil(log2(amax / max_normal)), decided exactly from amax's mantissa field
  (no rounded division).
  """
  e = f32_exponent(amax_b) - fmt.emax
  if cfg.scale_rounding == "rceil":
    mant = lax.bitcast_convert_type(amax_b, jnp.int32) & 0x7FFFFF
    e = e + (mant > fmt.max_significand_bits).astype(jnp.int32)
  return jnp.clip(e, formats.E8M0_MIN_EXP, formats.E8M0_MAX_EXP)


def _mx_scales(x_b, cfg, fmt, layout, tensor_amax):
  del tensor_amax  # rejected by check_tensor_amax
  amax_b = abs_max(x_b, layout.reduce_axes)
  e = _mx_shared_exp(amax_b, cfg, fmt)
  bits = jnp.where(jnp.isfinite(amax_b), e + formats.E8M0_BIAS, formats.E8M0_NAN_BITS)
  scale = lax.bitcast_convert_type(squeeze(bits.astype(jnp.uint8), layout), formats.E8M0_DTYPE)
  return scale, None


def _mx_scale_exponent(scale, layout) -> tuple[jax.Array, jax.Array]:
  """(e, is_nan) of E8M0 block scales, expanded to the blocked view's rank."""
  bits = unsqueeze(lax.bitcast_convert_type(scale, jnp.uint8), layout).astype(jnp.int32)
  return bits - formats.E8M0_BIAS, bits == formats.E8M0_NAN_BITS


def _mx_params(scale, outer, layout, cfg):
  """(encode multiplier 2**-e, (e, is_nan)) per block."""
  del outer, cfg
  e, is_nan = _mx_scale_exponent(scale, layout)
  # -e >= -126 since e <= 127 - emax + 1; the clip only matters for NaN blocks (any value).
  return pow2(jnp.clip(-e, -126, 127)), (e, is_nan)


def _mx_encode(x_f32: jax.Array, e_and_nan) -> jax.Array:
  """x * 2**-e exactly, FP32 subnormal x included.

  XLA CPU reads subnormal operands of float arithmetic as 0, so a subnormal x = m * 2**-149 is
  scaled from its integer mantissa m instead: float(m) * 2**(-149 - e) (exact). That is only
  normal for e <= -23; for larger e the result is below 2**-126 * 2**-(e+23), far under any
  element grid's smallest subnormal, and 0 is its round-to-nearest value (and SR's up-probability
  would be below 2**-100).
  """
  e, _ = e_and_nan
  normal = x_f32 * pow2(jnp.clip(-e, -126, 127))  # -e >= -126 except for NaN blocks (any value)
  bits = lax.bitcast_convert_type(x_f32, jnp.int32)
  mant = (bits & 0x7FFFFF).astype(jnp.float32)
  sub = jnp.where(e <= -23, mant * pow2(jnp.clip(-149 - e, -126, 127)), 0.0)
  is_sub = (bits & 0x7F800000) == 0
  return jnp.where(is_sub, with_sign_of(sub, x_f32), normal)


def _mx_apply(grid_b, e_and_nan, dtype):
  """grid * 2**e by adding e to the FP32 exponent field (exact), or, for results below 2**-126,
  by writing the FP32 subnormal's mantissa field grid * 2**(e + 149) (an exact integer: grid
  values are multiples of 2**-16 and e >= -127).

  Not a multiplication: 2**-127 is an FP32 subnormal, which XLA CPU reads as 0, and a split into two
  normal factors is undone by XLA's reassociation of multiplications. Results beyond FP32 become
  ±inf.
  """
  e, is_nan = e_and_nan
  g_bits = lax.bitcast_convert_type(grid_b, jnp.int32)
  sign = g_bits & jnp.int32(-0x80000000)
  new_exp = ((g_bits >> 23) & 0xFF) + e
  out_bits = jnp.where(new_exp >= 255, sign | 0x7F800000, g_bits + (e << 23))
  # Subnormal results (new_exp <= 0 implies e <= -23, so 2**(e + 149) is a normal FP32 number).
  sub_mant = (jnp.abs(grid_b) * pow2(jnp.clip(e + 149, -126, 127))).astype(jnp.int32)
  out_bits = jnp.where(new_exp <= 0, sign | sub_mant, out_bits)
  out_bits = jnp.where(grid_b == 0, sign, out_bits)
  out = lax.bitcast_convert_type(out_bits, jnp.float32)
  return jnp.where(is_nan | jnp.isnan(grid_b), jnp.nan, out).astype(dtype)


# TransformerEngine's NVFP4 conventions (scale_convention="te" | "te_v2_13"): te.py.


def _te_quantize(x_b, cfg, layout, key, tensor_amax):
  del key  # round to nearest only (config.py)
  amax_b = abs_max(x_b, layout.reduce_axes, paired=True)
  amax = nvfp4.outer_amax(amax_b, cfg, layout, tensor_amax)
  grid_b, s_b = te.quantize_blocked(x_b, amax_b, amax, cfg, layout.reduce_axes[0])
  outer_stored = squeeze(amax, layout) if cfg.per_token else amax
  return grid_b, squeeze(s_b, layout).astype(E4M3.dtype), outer_stored, te.decode_scale(
      s_b, amax, cfg)


def _te_params(scale, amax, layout, cfg):
  """(no encode multiplier, per-block decode scale) from the stored scales."""
  amax = unsqueeze(amax, layout) if amax.ndim else amax
  return None, te.decode_scale(unsqueeze(scale.astype(jnp.float32), layout), amax, cfg)


def _te_apply(grid_b, final_scale, dtype):
  return (grid_b * final_scale).astype(dtype)  # TE casts its FP32 product (dequantize_nvfp4.cuh)


# NVFP4: nvfp4.quantize_blocked and _te_quantize, which return the grid values and decode
# parameters too.
_SCALES = {"tensor": _tensor_scales, "mx": _mx_scales}
# Per-block (encode, decode) parameters from the stored scales, and the elementwise decode.
# quantize, dequantize and fake_quant all go through these.
_PARAMS = {"tensor": _tensor_params, "mx": _mx_params, "nvfp4": nvfp4.params,
           "nvfp4_te": _te_params}
_APPLY = {"tensor": _tensor_apply, "mx": _mx_apply, "nvfp4": nvfp4.apply,
          "nvfp4_te": _te_apply}


def _quantize_blocked(x, cfg, layout, key, tensor_amax):
  """(FP32 grid values in the blocked view, stored scale, stored outer, decode parameters)."""
  fmt = formats.element_format(cfg.fmt)
  x_b = x.reshape(layout.blocked_shape)  # scales read the input dtype, elements work in FP32
  if cfg.scheme == "nvfp4":
    return nvfp4.quantize_blocked(x_b, cfg, layout, key, tensor_amax)
  if cfg.scheme == "nvfp4_te":
    return _te_quantize(x_b, cfg, layout, key, tensor_amax)
  scale, outer = _SCALES[cfg.scheme](x_b, cfg, fmt, layout, tensor_amax)
  enc, dec = _PARAMS[cfg.scheme](scale, outer, layout, cfg)
  x_f32 = x_b.astype(jnp.float32)
  if cfg.kind == "mx":
    grid_b = _round(_mx_encode(x_f32, dec), fmt, cfg, key)
  else:
    grid_b = _round(x_f32 * enc, fmt, cfg, key)
  return grid_b, scale, outer, dec


# The public functions validate in Python (errors at trace time, before any compile), then run a
# jitted core: eager callers get one compiled program instead of dozens of op-by-op dispatches, and
# inside an outer jit the inner one is inlined.


@functools.partial(jax.jit, static_argnames=("cfg", "layout"))
def _quantize_jit(x, key, tensor_amax, *, cfg, layout):
  grid_b, scale, outer, _ = _quantize_blocked(x, cfg, layout, key, tensor_amax)
  codes = grid_b.reshape(layout.shape).astype(formats.element_format(cfg.fmt).dtype)
  return QTensor(codes=codes, scale=scale, outer=outer, cfg=cfg)


@functools.partial(jax.jit, static_argnames=("dtype", "layout"))
def _dequantize_jit(q, *, dtype, layout):
  grid_b = q.codes.astype(jnp.float32).reshape(layout.blocked_shape)
  _, dec = _PARAMS[q.cfg.scheme](q.scale, q.outer, layout, q.cfg)
  return _APPLY[q.cfg.scheme](grid_b, dec, dtype).reshape(layout.shape)


@functools.partial(jax.jit, static_argnames=("cfg", "layout"))
def _fake_quant_jit(x, key, tensor_amax, *, cfg, layout):
  if cfg.scheme == "nvfp4" and not cfg.stochastic_rounding:
    # Decoded values picked straight from per-block tables (the same values as below).
    x_b = x.reshape(layout.blocked_shape)
    return nvfp4.fake_quant_blocked(x_b, cfg, layout, tensor_amax).reshape(layout.shape)
  grid_b, _, _, dec = _quantize_blocked(x, cfg, layout, key, tensor_amax)
  return _APPLY[cfg.scheme](grid_b, dec, x.dtype).reshape(layout.shape)


def quantize(x: jax.Array, cfg: QuantConfig, key: jax.Array | None = None, *,
             tensor_amax: jax.Array | None = None) -> QTensor:
  """Quantizes x (f32/bf16/f16) to cfg's format; key is required iff cfg.stochastic_rounding.

  tensor_amax: optional (traced) scalar used instead of max|x| for the per-tensor scale of
    fp8_e4m3 / fp8_e5m2 / nvfp4 (not per_token), like an inference engine's static, calibrated
    activation scale; elements beyond it saturate to the format max. Block scales (NVFP4) still
    come from the data. A ValueError for formats without a per-tensor scale.
  """
  x = jnp.asarray(x)
  cfg, layout = _check(x, cfg, key)
  tensor_amax = check_tensor_amax(cfg, tensor_amax)
  return _quantize_jit(x, key if cfg.stochastic_rounding else None, tensor_amax, cfg=cfg,
                       layout=layout)


def dequantize(q: QTensor, dtype=jnp.float32) -> jax.Array:
  """codes * scale(s), computed in FP32, returned in `dtype`."""
  return _dequantize_jit(q, dtype=jnp.dtype(dtype),
                         layout=block_layout(tuple(q.codes.shape), q.cfg))


def fake_quant(x: jax.Array, cfg: QuantConfig, key: jax.Array | None = None, *,
               tensor_amax: jax.Array | None = None) -> jax.Array:
  """dequantize(quantize(x, cfg, key, tensor_amax=...)) in x.dtype, without materializing the
  low-precision codes."""
  x = jnp.asarray(x)
  cfg, layout = _check(x, cfg, key)
  tensor_amax = check_tensor_amax(cfg, tensor_amax)
  return _fake_quant_jit(x, key if cfg.stochastic_rounding else None, tensor_amax, cfg=cfg,
                         layout=layout)