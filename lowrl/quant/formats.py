"""Element-format constants: E4M3, E5M2, E2M1 elements and the E8M0 block scale.

Each element format is described by the few numbers the grid arithmetic in `rounding.py` needs
(mantissa bits, smallest normal exponent, max normal), plus its ml_dtypes type for storage.
"""
from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np


@dataclasses.dataclass(frozen=True)
class ElementFormat:
  """A signed minifloat element format (no infinities used: values saturate at max_normal).

  Attributes:
    name: short name ("e4m3", "e5m2", "e2m1").
    dtype: the ml_dtypes scalar type the codes are stored in.
    mantissa_bits: explicit mantissa bits.
    emin: exponent of the smallest normal (2**emin); subnormals are spaced
      2**(emin - mantissa_bits).
    emax: exponent of the largest binade (OCP `emax_elem`).
    max_normal: largest finite value.
  """

  name: str
  dtype: type
  mantissa_bits: int
  emin: int
  emax: int
  max_normal: float

  @property
  def min_subnormal(self) -> float:
    return 2.0 ** (self.emin - self.mantissa_bits)

  @property
  def max_significand_bits(self) -> int:
    """FP32 mantissa field (23 bits) of max_normal / 2**emax, e.g. 1.75 -> 0x600000.

    RCEIL scale selection compares a block amax's FP32 mantissa field with this to decide,
    exactly and without a division, whether amax / 2**(e - emax) still fits under max_normal.
    """
    return int(np.float32(self.max_normal / 2.0**self.emax).view(np.int32)) & 0x7FFFFF

  def grid(self) -> np.ndarray:
    """All non-negative finite values of the format (float64, ascending), for tests and docs."""
    n_codes = 16 if self.mantissa_bits == 1 else 256
    vals = np.arange(n_codes, dtype=np.uint8).view(self.dtype).astype(np.float64)
    return np.unique(np.abs(vals[np.isfinite(vals)]))


E4M3 = ElementFormat("e4m3", jnp.float8_e4m3fn, mantissa_bits=3, emin=-6, emax=8, max_normal=448.0)
E5M2 = ElementFormat("e5m2", jnp.float8_e5m2, mantissa_bits=2, emin=-14, emax=15,
                     max_normal=57344.0)
E2M1 = ElementFormat("e2m1", jnp.float4_e2m1fn, mantissa_bits=1, emin=0, emax=2, max_normal=6.0)

# E8M0 (`float8_e8m0fnu`): unsigned power-of-two scale 2**(bits - 127), bits 0xFF = NaN.
E8M0_DTYPE = jnp.float8_e8m0fnu
E8M0_BIAS = 127
E8M0_MIN_EXP = -127
E8M0_MAX_EXP = 127
E8M0_NAN_BITS = 0xFF

# Quantization format name (config.FORMATS) -> element format.
ELEMENT_FORMATS: dict[str, ElementFormat] = {
    "fp8_e4m3": E4M3,
    "fp8_e5m2": E5M2,
    "mxfp8_e4m3": E4M3,
    "mxfp8_e5m2": E5M2,
    "mxfp4": E2M1,
    "nvfp4": E2M1,
}

# NVFP4 outer-scale denominators: amax maps to (element max) * (block-scale max).
NVFP4_SCALE_MAX = 448.0
NVFP4_SCALE_MAX_FOUR_OVER_SIX = 256.0


def element_format(fmt: str) -> ElementFormat:
  """The element format of a quantization format name, e.g. "mxfp4" -> E2M1."""
  if fmt not in ELEMENT_FORMATS:
    raise ValueError(f"Unknown quantization format {fmt!r}; use one of {sorted(ELEMENT_FORMATS)}.")
  return ELEMENT_FORMATS[fmt]
