"""Orbax checkpoints of sharded training state, restored onto the saving mesh and others."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from configs import base as base_config
import tiny
from lowrl import sharding
from lowrl.models import init
from lowrl.training import optimizer
from lowrl.training.state import state_tree
from lowrl.training.checkpointing import Checkpointer

MODEL = tiny.SHARDABLE


def _plan(shape):
  n = int(np.prod(shape))
  return sharding.ShardingPlan(sharding.make_mesh(shape, ("data", "model"), jax.devices()[:n]))


def _state(plan):
  """The loop's checkpoint tree (params, Adam state, reference, a kept version, RNG) on `plan`."""
  params = init.init_params(MODEL, jax.random.key(0))
  tx = optimizer.make_optimizer(base_config.get_config("fp32").optimizer, 10)
  # Non-trivial optimizer state: one Adam step on a made-up gradient.
  grads = jax.tree.map(lambda p: jnp.sin(p * 3.0), params)
  moved, opt = optimizer.apply_update(tx, params, grads, optimizer.init_opt_state(tx, params),
                                      master_rounding="nearest", key=None)
  state = state_tree(moved, opt, jax.random.key_data(jax.random.key(7)), params,
                      {"3": jax.tree.map(lambda p: p * 2, params)})
  shapes = init.param_shapes(MODEL)
  return state, plan.put(state, plan.shardings_like_params(state, shapes))


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
  """(host state, checkpointer): the state saved once on a (4, 2) mesh, restored by every case."""
  host, saved = _state(_plan((4, 2)))
  ckpt = Checkpointer(str(tmp_path_factory.mktemp("sharded") / "ckpt"), every=1)
  ckpt.save(5, saved, {"data_position": 5}, force=True)
  ckpt.wait()
  assert saved["params"]["layers_0"]["mlp"]["up_proj"]["kernel"].sharding.spec == \
      jax.sharding.PartitionSpec("data", "model")
  return host, ckpt


@pytest.mark.parametrize("target", [(4, 2), (2, 4), (8, 1), (1, 1)])
def test_sharded_state_restores_onto_any_mesh(saved, target):
  host, ckpt = saved
  plan = _plan(target)
  shapes = jax.eval_shape(lambda: host)
  want = plan.shardings_like_params(shapes, init.param_shapes(MODEL))
  state, meta, step = ckpt.restore(sharding.abstract(shapes, want))
  assert (step, meta) == (5, {"data_position": 5})
  for got, expected, sh in zip(jax.tree.leaves(state), jax.tree.leaves(host),
                               jax.tree.leaves(want)):
    assert got.sharding == sh  # laid out for the new mesh, not the one that saved it
    np.testing.assert_array_equal(got, expected)
  # Spot-check the new layout: Adam's moments follow their parameters.
  mu = state["opt_state"][1][0].mu["layers_1"]["attn"]["o_proj"]["kernel"]
  data, model = target
  assert {s.data.shape for s in mu.addressable_shards} == {(64 // model, 64 // data)}
  assert state["rng"].sharding.is_fully_replicated
