"""E2M1 packing (two codes per byte) and bytes_per_param."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from lowrl.quant import (PackedWeight, QuantConfig, bytes_per_param, fake_quant, pack_e2m1,
                         pack_qtensor, quantize, unpack_e2m1)

E2M1 = jnp.float4_e2m1fn


def _nibbles(codes):
  return np.asarray(jax.lax.bitcast_convert_type(codes, jnp.uint4)).astype(np.uint8)


def test_pack_layout_golden():
  # 1.0 = 0b0010, -0.5 = 0b1001, 6.0 = 0b0111, -0.0 = 0b1000: element 2i -> low nibble.
  codes = jnp.asarray([1.0, -0.5, 6.0, -0.0], jnp.float32).astype(E2M1)
  packed = np.asarray(pack_e2m1(codes))
  assert packed.dtype == np.uint8
  np.testing.assert_array_equal(packed, [0x92, 0x87])
  back = unpack_e2m1(jnp.asarray(packed))
  np.testing.assert_array_equal(_nibbles(back), [0x2, 0x9, 0x7, 0x8])  # -0 survives


@given(seed=st.integers(0, 2**31 - 1), shape_axis=st.sampled_from([((6,), 0), ((3, 8), 1),
                                                                   ((4, 3), 0), ((2, 2, 6), 2)]))
def test_pack_roundtrip_all_codes(seed, shape_axis):
  shape, axis = shape_axis
  nib = np.random.default_rng(seed).integers(0, 16, shape).astype(np.uint8)  # every code incl. -0
  codes = jax.lax.bitcast_convert_type(jnp.asarray(nib).astype(jnp.uint4), E2M1)
  packed = pack_e2m1(codes, axis=axis)
  assert packed.shape[axis] == shape[axis] // 2
  np.testing.assert_array_equal(_nibbles(unpack_e2m1(packed, axis=axis)), nib)


def test_pack_quantized_tensor_roundtrip():
  q = quantize(jax.random.normal(jax.random.key(0), (4, 32)), QuantConfig("nvfp4"))
  np.testing.assert_array_equal(_nibbles(unpack_e2m1(pack_e2m1(q.codes))), _nibbles(q.codes))


def test_pack_errors():
  with pytest.raises(ValueError, match="odd"):
    pack_e2m1(jnp.zeros((3, 5), E2M1))
  with pytest.raises(ValueError, match="float4_e2m1fn"):
    pack_e2m1(jnp.zeros((4,), jnp.float8_e4m3fn))
  with pytest.raises(ValueError, match="uint8"):
    unpack_e2m1(jnp.zeros((4,), jnp.int32))


def test_bytes_per_param():
  shape = (4096, 4096)
  n = 4096 * 4096
  assert bytes_per_param(QuantConfig("fp8_e4m3"), shape) == 1 + 4 / n
  assert bytes_per_param(QuantConfig("mxfp8_e5m2"), shape) == 8.25 / 8
  assert bytes_per_param(QuantConfig("mxfp4"), shape) == 4.25 / 8
  assert bytes_per_param(QuantConfig("nvfp4"), shape) == (4.5 + 32 / n) / 8
  # Per-token: one FP32 outer scale per row (4096 rows) -> +32/4096 bits per element.
  assert bytes_per_param(QuantConfig("nvfp4", per_token=True), shape) == (4.5 + 32 / 4096) / 8
  assert bytes_per_param(QuantConfig("nvfp4", block_2d=True), shape) == (4 + 8 / 256 + 32 / n) / 8
  assert bytes_per_param(QuantConfig("mxfp4", block_size=16), shape) == 4.5 / 8


@pytest.mark.parametrize("cfg", [
    QuantConfig("nvfp4", axis=0), QuantConfig("nvfp4", axis=1, per_token=True),
    QuantConfig("nvfp4", block_2d=True), QuantConfig("mxfp4", axis=0),
    QuantConfig("mxfp8_e4m3", axis=1), QuantConfig("fp8_e4m3")], ids=str)
def test_packed_weight_is_fake_quant_and_stores_bytes_per_param(cfg):
  x = jax.random.normal(jax.random.key(3), (64, 96), jnp.float32) * 3.0
  w = pack_qtensor(quantize(x, cfg))
  assert isinstance(w, PackedWeight) and w.nibbles == (cfg.fmt in ("nvfp4", "mxfp4"))
  # Held packed, it dequantizes to exactly what the forward's weight quantizer computes.
  np.testing.assert_array_equal(np.asarray(w.dequantize()), np.asarray(fake_quant(x, cfg)))
  assert w.num_elements == x.size
  # Its storage is the format's documented cost (codes + block scales + outer scales).
  assert w.nbytes == pytest.approx(bytes_per_param(cfg, x.shape) * x.size, rel=0, abs=1e-9)
