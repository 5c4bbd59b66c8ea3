"""Quantization blocks vs shards (lowrl.quant_blocks): a block that would straddle a shard
boundary, or a width it does not divide, is refused before any compile (8 fake CPU devices,
conftest.py)."""
import dataclasses

import pytest

import tiny
from lowrl import precision, quant_blocks, sharding
from lowrl.models import layout

# H=8, K=4 heads of 8: every projection width and K divide by 4 (whole heads per tensor shard).
MODEL = tiny.SHARDABLE
FP32 = precision.PrecisionPolicy.unquantized(layout.matmuls(MODEL))


def _plan(shape):
  return sharding.ShardingPlan(sharding.make_mesh(shape, ("data", "model")))


def _nvfp4(cfg, **kw):
  return precision.policy_for("nvfp4_naive", layout.matmuls(cfg), **kw)


def test_quant_blocks_that_would_straddle_shards_are_rejected():
  # FSDP over 8 devices leaves 64 / 8 = 8 rows of each column-parallel kernel per shard: NVFP4
  # blocks of 16 along that contracting axis would straddle shards.
  with pytest.raises(ValueError, match=r"layers_0/attn/q_proj weights .* 8 per shard"):
    quant_blocks.check_quant_blocks(_nvfp4(MODEL), MODEL, _plan((8, 1)))
  # Row-parallel: o_proj's input (H*hd = 32 wide) is split 4 ways by tensor parallelism.
  narrow = dataclasses.replace(MODEL, d_model=128, n_heads=4, n_kv_heads=4)
  with pytest.raises(ValueError, match=r"layers_0/attn/o_proj activations .* 8 per shard"):
    quant_blocks.check_quant_blocks(_nvfp4(narrow), narrow, _plan((2, 4)))
  # Quantized backward: the dgrad GEMM blocks run along the output axis (k_proj: K*hd = 32 split
  # 4 ways), the wgrad GEMM blocks along batch x time, split over "data".
  quant_bwd = _nvfp4(MODEL, backward="quantized")
  with pytest.raises(ValueError, match=r"k_proj dgrad gradient .* output axis.* 8 per shard"):
    quant_blocks.check_quant_blocks(quant_bwd, MODEL, _plan((2, 4)))
  quant_blocks.check_quant_blocks(quant_bwd, MODEL, _plan((4, 2)), rows=8, seq_len=8)
  with pytest.raises(ValueError, match=r"wgrad gradient .* batch x time .* 8 per shard"):
    quant_blocks.check_quant_blocks(quant_bwd, MODEL, _plan((4, 2)), rows=4, seq_len=8)
  # Aligned blocks pass, and unquantized matmuls are never constrained.
  quant_blocks.check_quant_blocks(_nvfp4(MODEL), MODEL, _plan((2, 4)))
  quant_blocks.check_quant_blocks(FP32, MODEL, _plan((8, 1)))
  fsdp_free = _nvfp4(MODEL, high_precision_paths=".*/(q|k|v)_proj|.*/(gate|up)_proj")
  quant_blocks.check_quant_blocks(fsdp_free, MODEL, _plan((8, 1)))
