"""Storage: E2M1 codes two per byte, a quantized tensor held packed, and the real bytes per
parameter of each format.

Byte layout of `pack_e2m1`: along the packed axis, element 2i goes to the low nibble and element
2i+1 to the high nibble of byte i (the OCP MX / NVFP4 convention: the first element is the least
significant nibble). Nibbles are the raw E2M1 bit patterns (sign bit 3), so -0 survives.
"""
from __future__ import annotations

import functools
import math

from typing import Any

import jax
import jax.numpy as jnp
from flax import struct
from jax import lax

from lowrl.quant.config import QuantConfig
from lowrl.quant.quantize import QTensor, dequantize

_E2M1 = jnp.float4_e2m1fn


def _pair_axis(shape: tuple[int, ...], axis: int, what: str) -> int:
  if not shape or not -len(shape) <= axis < len(shape):
    raise ValueError(f"{what}: axis={axis} is out of range for shape {shape}.")
  return axis % len(shape)


def pack_e2m1(codes: jax.Array, axis: int = -1) -> jax.Array:
  """float4_e2m1fn codes -> uint8, two codes per byte along `axis` (its length must be even)."""
  if codes.dtype != _E2M1:
    raise ValueError(f"pack_e2m1 takes float4_e2m1fn codes, got {codes.dtype}; quantize first.")
  axis = _pair_axis(codes.shape, axis, "pack_e2m1")
  n = codes.shape[axis]
  if n % 2:
    raise ValueError(f"pack_e2m1: codes.shape[{axis}]={n} is odd; two codes share a byte, so pad "
                     f"axis {axis} to an even length.")
  return _pack(codes, axis)


@functools.partial(jax.jit, static_argnums=1)
def _pack(codes, axis):
  n = codes.shape[axis]
  nib = lax.bitcast_convert_type(codes, jnp.uint4).astype(jnp.uint8)
  nib = nib.reshape(codes.shape[:axis] + (n // 2, 2) + codes.shape[axis + 1:])
  lo = lax.index_in_dim(nib, 0, axis + 1, keepdims=False)
  hi = lax.index_in_dim(nib, 1, axis + 1, keepdims=False)
  return lo | (hi << 4)


def unpack_e2m1(packed: jax.Array, axis: int = -1) -> jax.Array:
  """Inverse of pack_e2m1: uint8 -> float4_e2m1fn with `axis` twice as long."""
  if packed.dtype != jnp.uint8:
    raise ValueError(f"unpack_e2m1 takes uint8 bytes, got {packed.dtype}.")
  return _unpack(packed, _pair_axis(packed.shape, axis, "unpack_e2m1"))


@functools.partial(jax.jit, static_argnums=1)
def _unpack(packed, axis):
  nib = jnp.stack([packed & 0xF, packed >> 4], axis=axis + 1)
  shape = packed.shape[:axis] + (2 * packed.shape[axis],) + packed.shape[axis + 1:]
  return lax.bitcast_convert_type(nib.reshape(shape).astype(jnp.uint4), _E2M1)


@struct.dataclass
class PackedWeight:
  """A tensor held quantized: codes (E2M1 two per byte as uint8, or FP8), block and outer scales.

  `dequantize()` gives exactly `fake_quant(x, cfg)` of the tensor it was packed from (in FP32).
  """

  codes: jax.Array
  scale: jax.Array
  outer: jax.Array | None
  cfg: Any = struct.field(pytree_node=False)  # QuantConfig, axis resolved
  nibbles: bool = struct.field(pytree_node=False, default=False)  # codes packed two per byte

  @property
  def nbytes(self) -> int:
    return sum(int(a.nbytes) for a in (self.codes, self.scale, self.outer) if a is not None)

  @property
  def num_elements(self) -> int:
    """Elements of the tensor it holds (two per byte when `nibbles`)."""
    return int(self.codes.size) * (2 if self.nibbles else 1)

  def dequantize(self) -> jax.Array:
    codes = unpack_e2m1(self.codes, axis=self.cfg.axis) if self.nibbles else self.codes
    q = QTensor(codes=codes, scale=self.scale, outer=self.outer, cfg=self.cfg)
    return dequantize(q, jnp.float32)


def pack_qtensor(q: QTensor) -> PackedWeight:
  """`q` for storage: E2M1 codes two per byte along the quantization axis, other codes as they are."""
  nibbles = q.codes.dtype == _E2M1
  codes = pack_e2m1(q.codes, axis=q.cfg.axis) if nibbles else q.codes
  return PackedWeight(codes, q.scale, q.outer, q.cfg, nibbles)


_ELEMENT_BITS = {"fp8_e4m3": 8, "fp8_e5m2": 8, "mxfp8_e4m3": 8, "mxfp8_e5m2": 8, "mxfp4": 4,
                 "nvfp4": 4}


def bytes_per_param(cfg: QuantConfig, shape: tuple[int, ...]) -> float:
  """Storage bytes per element of a tensor of `shape` quantized with cfg, scales included.

  FP8: 1 byte + one FP32 scale per tensor. MXFP8: 1 + 1/32 (8.25 bits). MXFP4: 1/2 + 1/32
  (4.25 bits, E2M1 packed two per byte). NVFP4: 1/2 + 1/16 (4.5 bits) + the FP32 outer scale(s): one per tensor,
  or one per row (per_token).
  """
  shape = tuple(int(s) for s in shape)
  numel = math.prod(shape)
  if numel == 0:
    raise ValueError(f"bytes_per_param of an empty shape {shape} is undefined.")
  total_bits = numel * _ELEMENT_BITS[cfg.fmt]
  if cfg.kind == "tensor":
    total_bits += 32
  else:
    total_bits += 8 * numel / cfg.block / (cfg.block if cfg.block_2d else 1)
  if cfg.kind == "nvfp4":
    n_outer = numel // shape[cfg.axis] if cfg.per_token else 1
    total_bits += 32 * n_outer
  return total_bits / 8 / numel
