"""experiments/bench_quant.py --stages: the stage programs compute the quantizer's own values
(the block amax of the data, and the block scales `quantize` stores), only for the spec-exact
round-to-nearest NVFP4 formats."""
import jax
import jax.numpy as jnp
import numpy as np

from experiments import bench_quant
from lowrl.quant import quantize


def test_stage_programs_compute_the_quantizers_block_amax_and_scales():
  x = (jax.random.normal(jax.random.key(3), (8, 64), jnp.float32) * 3).astype(jnp.bfloat16)
  fns = bench_quant._stage_candidates(["nvfp4_pt_4o6", "nvfp4_sr", "nvfp4_te", "fp8_e4m3"],
                                      x.shape)
  assert sorted(fns) == ["nvfp4_pt_4o6/amax", "nvfp4_pt_4o6/scales"]
  one = jnp.float32(1)
  amax = np.asarray(fns["nvfp4_pt_4o6/amax"](x, one))[..., 0]
  want = np.abs(np.asarray(x, np.float32)).reshape(8, 4, 16).max(-1)
  np.testing.assert_array_equal(amax, want)
  s_block = np.asarray(fns["nvfp4_pt_4o6/scales"](x, one)[0])[..., 0]
  stored = quantize(x, bench_quant.FORMATS["nvfp4_pt_4o6"]).scale.astype(jnp.float32)
  np.testing.assert_array_equal(s_block, np.asarray(stored))
