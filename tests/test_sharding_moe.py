"""Expert parallelism: the routed experts' E dimension on a mesh axis by the rules mechanism, the
block check covering expert kernels, and the sharded MoE forward against one device (8 fake CPU
devices, conftest.py)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import tiny
from lowrl import precision, quant_blocks, sharding
from lowrl.models import init, layout, transformer

MODEL = tiny.MOE
AXES = ("data", sharding.EXPERT, "model")
TOKENS = jax.random.randint(jax.random.key(1), (8, 8), 0, MODEL.vocab_size)


def _plan(shape=(2, 4, 1)):
  return sharding.ShardingPlan(sharding.make_mesh(shape, AXES),
                               rules=sharding.expert_parallel_rules(),
                               batch_axes=("data", sharding.EXPERT))


def _host_params():
  return jax.tree.map(np.asarray, init.init_params(MODEL, jax.random.key(0)))


def test_experts_are_split_over_the_expert_axis():
  plan = _plan()
  params = plan.put(_host_params(), plan.param_shardings(_host_params()))
  kernel = params["layers_0"]["mlp"]["experts"]["up_proj"]["kernel"]  # [E=4, D, F]
  assert kernel.sharding.spec == P(sharding.EXPERT, "data", "model")  # model: size 1
  assert {s.data.shape for s in kernel.addressable_shards} == {(1, 16, 32)}
  assert params["layers_0"]["mlp"]["router"]["kernel"].sharding.spec == P()
  assert not plan.fallbacks(params)
  # Dense rules keep every expert on every device.
  dense = sharding.ShardingPlan(sharding.make_mesh((8, 1), ("data", "model")))
  assert dense.param_spec(("layers_0", "mlp", "experts", "down_proj", "kernel"),
                          (4, 32, 32)) == P(None, "model", "data")


@pytest.mark.parametrize("recipe", ["fp32", "nvfp4_moe_experts"])
def test_expert_parallel_forward_matches_one_device(recipe):
  policy = precision.policy_for(recipe, layout.matmuls(MODEL))
  plan = _plan()
  quant_blocks.check_quant_blocks(policy, MODEL, plan)
  fwd = jax.jit(transformer.forward, static_argnums=(2, 3))
  ref = np.asarray(fwd(_host_params(), TOKENS, MODEL, policy))
  params = plan.put(_host_params(), plan.param_shardings(_host_params()))
  tokens = plan.put(np.asarray(TOKENS), plan.batch)
  with plan.rows():
    got = np.asarray(fwd(params, tokens, MODEL, policy))
  # Same quantized operands (blocks are shard-local); only reductions split over devices are
  # reassociated: FP32 (BF16 GEMM inputs, FP32 accumulation) sums of O(100) terms.
  np.testing.assert_allclose(got, ref, rtol=0, atol=2e-5 * np.abs(ref).max())


def test_block_check_covers_expert_kernels():
  policy = precision.policy_for("nvfp4_moe_experts", layout.matmuls(MODEL))
  # D = 32 split 4 ways over "data": 8 per shard, half an NVFP4 block.
  plan = sharding.ShardingPlan(sharding.make_mesh((4, 2, 1), AXES),
                               rules=sharding.expert_parallel_rules(),
                               batch_axes=("data", sharding.EXPERT))
  with pytest.raises(ValueError, match=r"layers_0/mlp/experts/(gate|up)_proj weights"):
    quant_blocks.check_quant_blocks(policy, MODEL, plan)
