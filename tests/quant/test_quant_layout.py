"""Block layout helpers (`lowrl.quant.layout`): the paired 16-bit block amax against numpy's float
max."""

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from lowrl.quant import layout

f32 = np.float32


def _ref_abs_max(x: np.ndarray, axis) -> np.ndarray:
  """max |x| in FP32 with NaN propagating (numpy's float max)."""
  return np.max(np.abs(x.astype(f32)), axis=axis, keepdims=True)


@pytest.mark.parametrize("dtype", [ml_dtypes.bfloat16, np.float16], ids=["bf16", "f16"])
def test_paired_abs_max_matches_float_max(dtype):
  """Random bit patterns (NaN, inf, subnormals, -0 among them) in 16-wide blocks: the paired
  int32 reduction gives numpy's float max |x| (NaN where a block has a NaN); also over the
  whole tensor, along a non-last axis and for an odd last axis (the unpaired path)."""
  rng = np.random.default_rng(2)
  bits = rng.integers(0, 2**16, (64, 8, 16), dtype=np.uint16)
  bits[0] = 0x8000  # -0 block
  bits[1, :, 3] = 0x7F80 if dtype is ml_dtypes.bfloat16 else 0x7C00  # +inf
  x = bits.view(dtype)
  clean = np.where(np.isnan(x.astype(f32)), dtype(1.0), x)  # blocks without NaN, for exact values
  for arr in (x, clean):
    for axes, ref_axis in [((2,), 2), (None, None), ((0,), 0)]:
      got = np.asarray(layout.abs_max(jnp.asarray(arr), axes, paired=True))
      want = _ref_abs_max(arr, ref_axis)
      np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
      np.testing.assert_array_equal(np.where(np.isnan(got), 0, got), np.where(np.isnan(want), 0,
                                                                              want))
  odd = clean[:, :, :15]
  got = np.asarray(layout.abs_max(jnp.asarray(odd), (2,), paired=True))
  np.testing.assert_array_equal(got, _ref_abs_max(odd, 2))
