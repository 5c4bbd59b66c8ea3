"""Independent NumPy reference quantizers for the tests (host FP32 arithmetic + ml_dtypes casts).

They follow the scale formulas documented in lowrl/quant/quantize.py, but compute MX exponents
from float64 log2 (not bit tricks) and round elements with `astype(ml_dtypes type)`, so agreement
with the JAX fast path (FP32 grid arithmetic) is a real check. NVFP4 follows the spec-exact
definition (docs/reference.md §2) with exact rational arithmetic (`exact_fake_quant`).
"""
import ml_dtypes
import numpy as np

from lowrl.quant.formats import element_format

f32 = np.float32


def _cast(y, fmt):
  """Saturate, then the ml_dtypes round-to-nearest-even cast, back to FP32."""
  return np.clip(y, -fmt.max_normal, fmt.max_normal).astype(fmt.dtype).astype(f32)


def _recip(s):
  with np.errstate(divide="ignore", invalid="ignore"):
    return np.where(s > 0, f32(1) / np.where(s > 0, s, f32(1)), f32(0)).astype(f32)


def _blocks(x, axis, bs):
  x = np.moveaxis(x, axis, -1)
  return x.reshape(x.shape[:-1] + (x.shape[-1] // bs, bs))


def _unblocks(xb, axis):
  x = xb.reshape(xb.shape[:-2] + (-1,))
  return np.moveaxis(x, -1, axis)


def ref_fake_quant(x, cfg, dtype=np.float32):
  """Dequantized values of x under cfg (round to nearest even), as FP32 numbers: FP32 results
  (per-tensor FP8, MX), or for NVFP4 rounded once to `dtype` (exact_fake_quant)."""
  x = np.asarray(x, f32)
  fmt = element_format(cfg.fmt)
  with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
    if cfg.kind == "tensor":
      amax = np.max(np.abs(x))
      s = f32(amax * f32(1 / fmt.max_normal)) if np.isfinite(amax) else f32(np.nan)
      return (_cast(x * _recip(s), fmt) * s).astype(f32)
    if cfg.kind == "mx":
      xb = _blocks(x, cfg.axis, cfg.block).astype(np.float64)
      amax = np.max(np.abs(xb), axis=-1, keepdims=True)
      if cfg.scale_rounding == "floor":
        e = np.floor(np.log2(amax)) - fmt.emax
      else:
        e = np.ceil(np.log2(amax / fmt.max_normal))
      e = np.clip(np.nan_to_num(e, nan=0.0, neginf=-127.0, posinf=127.0), -127, 127)
      codes = _cast((xb * 2.0 ** -e).astype(f32), fmt).astype(np.float64)
      out = np.where(np.isfinite(amax), codes * 2.0 ** e, np.nan).astype(f32)
      return _unblocks(out, cfg.axis)
    # NVFP4 (1-D blocks along cfg.axis; 2-D tiles handled by the caller's transposes in tests):
    # the exact-rounding definition below.
    return exact_fake_quant(x, cfg, dtype=dtype)


def grid_neighbours(y, fmt):
  """(lower, upper) grid points around FP32/64 values y (|y| <= max_normal), float64."""
  pos = fmt.grid()
  full = np.unique(np.concatenate([-pos, pos]))
  y = np.asarray(y, np.float64)
  hi_idx = np.clip(np.searchsorted(full, y, side="left"), 0, len(full) - 1)
  lo_idx = np.clip(np.searchsorted(full, y, side="right") - 1, 0, len(full) - 1)
  return full[lo_idx], full[hi_idx]


def ml_dtypes_cast(y, dtype):
  """astype through ml_dtypes on the host (for bit-exact comparisons)."""
  return np.asarray(y, f32).astype(dtype).astype(f32)


__all__ = ["ref_fake_quant", "grid_neighbours", "ml_dtypes_cast"]


# ---------------------------------------------------------------------------------------------
# Exact-rounding NVFP4 reference (docs/reference.md §2 "spec-exact"): every rounding is one
# round-to-nearest-even of the exact rational value, computed with fractions.Fraction.

from fractions import Fraction  # noqa: E402


def _rne_grid(v: Fraction, grid: list) -> Fraction:
  """RNE of v >= 0 onto an ascending grid of Fractions (grid index parity = code parity),
  saturating at the top."""
  if v >= grid[-1]:
    return grid[-1]
  lo_i = max(i for i in range(len(grid)) if grid[i] <= v)
  lo, hi = grid[lo_i], grid[lo_i + 1]
  mid = (lo + hi) / 2
  if v < mid:
    return lo
  if v > mid:
    return hi
  return lo if lo_i % 2 == 0 else hi


def _grid(fmt_name):
  return [Fraction(float(g)) for g in element_format(fmt_name).grid()]


def rne_f32(v: Fraction, mantissa_bits: int = 23) -> f32:
  """Exact value -> nearest FP32 (ties to even), flushing results below 2**-126 to 0 like XLA.
  mantissa_bits=7: the nearest BF16 value (same exponent range), as an FP32 number."""
  if v == 0:
    return f32(0)
  sign = -1 if v < 0 else 1
  v = abs(v)
  e = v.numerator.bit_length() - v.denominator.bit_length()
  if Fraction(2) ** e > v:
    e -= 1
  # v in [2**e, 2**(e+1)): 24 significant bits -> integer part of v * 2**(23 - e).
  scaled = v * Fraction(2) ** (mantissa_bits - e)
  m, rem = divmod(scaled.numerator, scaled.denominator)
  half = Fraction(rem, scaled.denominator)
  if half > Fraction(1, 2) or (half == Fraction(1, 2) and m % 2 == 1):
    m += 1
  out = float(m) * 2.0 ** (e - mantissa_bits)
  if out < 2.0 ** -126:
    return f32(0.0 * sign)
  return f32(sign * out)


def exact_fake_quant(x, cfg, tensor_amax=None, dtype=np.float32):
  """Dequantized values of x under an NVFP4 cfg with exact rounding (1-D blocks), as FP32 numbers:
  s_global = RNE_f32(amax / D); s_block = RNE_e4m3(amax_block / (target * s_global)) (saturating
  at 448); code = RNE_e2m1(x / (s_block * s_global)) (saturating at 6); dq = RNE_dtype(code *
  s_block * s_global), one rounding of the exact product to `dtype` (float32 or bfloat16). 4/6 keeps
  4 only when the exact squared (mse) or absolute (mae) error sum of its exact dequantized values
  code * s_block * s_global over the block is strictly smaller (so the choice does not depend on
  `dtype`). Per-tensor FP8 (fp8_e4m3 / e5m2, FP32 only): s = RNE_f32(amax / max) and
  dq = RNE_f32(RNE_fmt(x / s) * s)."""
  mant = {np.dtype(np.float32): 23, np.dtype(ml_dtypes.bfloat16): 7}[np.dtype(dtype)]
  x = np.asarray(x, f32)
  fmt = element_format(cfg.fmt)
  grid = _grid(cfg.fmt)
  if cfg.kind == "tensor":
    amax = np.max(np.abs(x)) if tensor_amax is None else f32(tensor_amax)
    if not np.isfinite(amax) or amax < 0:
      return np.full_like(x, np.nan)
    s = Fraction(float(f32(amax * f32(1 / fmt.max_normal))))  # lowrl's documented FP8 scale
    out = np.empty_like(x)
    for i, v in np.ndenumerate(x):
      if np.isnan(v):
        out[i] = np.nan
        continue
      q = _rne_grid(abs(Fraction(float(min(abs(v), f32(np.finfo(f32).max))))) / s, grid) if s else 0
      out[i] = rne_f32(Fraction(q) * s) * (1 if v > 0 or (v == 0 and not np.signbit(v)) else -1)
    return out
  assert cfg.kind == "nvfp4" and not cfg.block_2d
  xb = _blocks(x, cfg.axis, cfg.block)
  denom = 6 * (256 if cfg.four_over_six else 448)
  e4m3 = _grid("fp8_e4m3")
  out = np.empty_like(xb)
  rows = xb.reshape(-1, xb.shape[-2], xb.shape[-1])
  flat_out = out.reshape(rows.shape)
  if tensor_amax is not None:
    amaxes = [f32(tensor_amax)] * len(rows)
  elif cfg.per_token:
    amaxes = [np.max(np.abs(r)) for r in rows]
  else:
    amaxes = [np.max(np.abs(x))] * len(rows)
  for ri, (row, amax) in enumerate(zip(rows, amaxes)):
    if not np.isfinite(amax) or amax < 0:
      flat_out[ri] = np.nan
      continue
    sg = Fraction(float(rne_f32(Fraction(float(amax)) / denom)))
    for bi, blk in enumerate(row):
      if np.isnan(blk).any():
        flat_out[ri, bi] = np.nan
        continue
      bmax = Fraction(float(min(np.max(np.abs(blk)), f32(np.finfo(f32).max))))
      if np.isinf(blk).any():
        bmax = Fraction(10) ** 40  # saturates any scale

      def quant(target):
        sb = _rne_grid(bmax / (target * sg), e4m3) if sg else Fraction(0)
        big_s = sb * sg
        dq, err_sq, err_abs = [], Fraction(0), Fraction(0)
        for v in blk:
          fv = Fraction(float(v)) if np.isfinite(v) else Fraction(10) ** 40 * (1 if v > 0 else -1)
          code = _rne_grid(abs(fv) / big_s, grid) if big_s else Fraction(0)
          neg = v < 0 or (v == 0 and np.signbit(v))
          d = rne_f32(code * big_s, mant)
          dq.append(-d if neg else d)
          diff = code * big_s * (-1 if neg else 1) - fv
          err_sq += diff * diff
          err_abs += abs(diff)
        return np.asarray(dq, f32), (err_sq if cfg.four_over_six_metric == "mse" else err_abs)

      dq6, err6 = quant(6)
      if cfg.four_over_six:
        dq4, err4 = quant(4)
        if err4 < err6:
          dq6 = dq4
      flat_out[ri, bi] = dq6
  return _unblocks(out, cfg.axis)


# ---------------------------------------------------------------------------------------------
# Stochastic-rounding NVFP4 scales: the exact ceilings (so that no element saturates).


def ceil_grid(v: Fraction, grid: list) -> Fraction:
  """Smallest grid value >= v (v >= 0), saturating at the top."""
  return next((g for g in grid if g >= v), grid[-1])


def ceil_f32(v: Fraction) -> Fraction:
  """Smallest FP32 value >= v > 0 (normal range), as a Fraction."""
  r = Fraction(float(rne_f32(v)))
  if r >= v:
    return r
  return Fraction(float(np.nextafter(f32(float(r)), f32(np.inf))))


def sr_nvfp4_scales(x, cfg):
  """(s_global, s_block) of each element of a 2-D x under an NVFP4 SR cfg (1-D blocks along the
  last axis), exact Fractions in nested lists [row][block]: s_global = ceil_f32(amax / D),
  s_block = ceil_e4m3(amax_block / (6 s_global))."""
  x = np.asarray(x, f32)
  denom = 6 * (256 if cfg.four_over_six else 448)
  e4m3 = _grid("fp8_e4m3")
  rows = []
  for row in x:
    amax = Fraction(float(np.max(np.abs(row if cfg.per_token else x))))
    sg = ceil_f32(amax / denom)
    blocks = row.reshape(-1, cfg.block)
    rows.append([(sg, ceil_grid(Fraction(float(np.max(np.abs(b)))) / (6 * sg), e4m3))
                 for b in blocks])
  return rows
