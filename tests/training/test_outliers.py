"""lowrl.training.outliers: planted outlier channels leave the FP32 function unchanged (up to the
rounding of x g and / g), show in the probe's per-channel ratio, and the knob reaches the loaded
base without changing the stored one or the fingerprints of configs without it."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import tiny

from lowrl import precision
from lowrl.models import init, layout, transformer
from lowrl.training import outliers, run_config
from lowrl.training.setup import build

CFG = tiny.SHARDABLE  # d_model 64: 4 channels, one per 16-block


def test_channels_are_evenly_spaced_one_per_block():
  assert outliers.channels(64, 4) == (8, 24, 40, 56)
  assert outliers.channels(256, 4) == (32, 96, 160, 224)
  assert outliers.channels(64, 0) == ()
  with pytest.raises(ValueError, match="outlier_channels=65"):
    outliers.channels(64, 65)


def test_planting_keeps_the_function_and_creates_the_outliers():
  params = init.init_params(CFG, jax.random.key(0))
  planted = outliers.plant(params, CFG, 4, 16.0)
  fp32 = precision.PrecisionPolicy.unquantized(layout.matmuls(CFG), "float32", name="fp32")
  tokens = jax.random.randint(jax.random.key(1), (2, 12), 0, CFG.vocab_size)
  a = transformer.forward(params, tokens, CFG, fp32)
  b = transformer.forward(planted, tokens, CFG, fp32)
  # x 16 and / 16 are exact in binary floating point (powers of two): the same numbers bit for
  # bit, whatever the summation order.
  np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  s0 = outliers.channel_stats(params, tokens, None, CFG)
  s1 = outliers.channel_stats(planted, tokens, None, CFG)
  for norm in s0:
    assert s1[norm]["max_over_median"] > 5 * s0[norm]["max_over_median"], norm
    assert s1[norm]["top"] in outliers.channels(64, 4) and s1[norm]["kurtosis"] > 10
  # Only the norm gains and the reading kernels' rows changed.
  assert np.array_equal(params["layers_0"]["attn"]["o_proj"]["kernel"],
                        planted["layers_0"]["attn"]["o_proj"]["kernel"])
  k0, k1 = (np.asarray(p["layers_1"]["mlp"]["up_proj"]["kernel"]) for p in (params, planted))
  np.testing.assert_array_equal(k1[8], k0[8] / 16)
  np.testing.assert_array_equal(np.delete(k1, [8, 24, 40, 56], 0),
                                np.delete(k0, [8, 24, 40, 56], 0))


def test_the_knob_is_fingerprinted_only_when_set_and_the_stored_base_is_shared():
  cfg = tiny.loop_config("bf16")
  fp, setup = run_config.fingerprint(cfg), build(cfg)
  assert setup.base.outliers == (0, 1.0)
  cfg.sft.outlier_channels, cfg.sft.outlier_gain = 4, 16.0
  on = build(cfg)
  assert run_config.fingerprint(cfg) != fp and on.base.outliers == (4, 16.0)
  assert on.base.fingerprint == setup.base.fingerprint  # one stored base, planted on loading
  cfg.sft.outlier_gain = 0.5
  with pytest.raises(ValueError, match="--config.sft.outlier_gain"):
    build(cfg)
