"""Independent NumPy reference quantizers for the tests (host FP32 arithmetic + ml_dtypes casts).

They follow the scale formulas documented in lowrl/quant/quantize.py, but compute MX exponents
from float64 log2 (not bit tricks) and round elements with `astype(ml_dtypes type)`, so agreement
with the JAX fast path (FP32 grid arithmetic) is a real check.
"""
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


def ref_fake_quant(x, cfg):
  """FP32 dequantized values of x under cfg (round to nearest even)."""
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
    # NVFP4 (1-D blocks along cfg.axis; 2-D tiles handled by the caller's transposes in tests).
    assert not cfg.block_2d
    xb = _blocks(x, cfg.axis, cfg.block)
    amax_b = np.max(np.abs(xb), axis=-1, keepdims=True)
    amax = np.max(amax_b, axis=(-2, -1), keepdims=True) if cfg.per_token else np.max(amax_b)
    denom = 6 * (256 if cfg.four_over_six else 448)
    outer = np.where(np.isfinite(amax), amax * f32(1 / denom), np.nan).astype(f32)

    def quant(target):
      ratio = amax_b * (f32(1 / target) * _recip(outer)).astype(f32)
      s_block = _cast(ratio.astype(f32), element_format("fp8_e4m3"))
      big_s = (s_block * outer).astype(f32)
      y = (xb * _recip(big_s)).astype(f32)
      dq = (_cast(y, fmt) * big_s).astype(f32)
      rel = (np.abs(dq - xb) * _recip(amax_b)).astype(f32)
      if cfg.four_over_six_metric == "mse":
        rel = (rel * rel).astype(f32)
      units = np.round(rel * f32(2**20)).astype(np.int64)  # fixed point, exact integer sums
      return dq, units.sum(-1, keepdims=True)

    out, err = quant(6.0)
    if cfg.four_over_six:
      out4, err4 = quant(4.0)
      out = np.where(err4 < err, out4, out)
    return _unblocks(out, cfg.axis)


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
