"""Where the reference and the async versions are kept (`rl.ref_storage`,
`async_rl.version_storage`): host offload gives the loop's numbers bit for bit."""
import json
import os

import jax.numpy as jnp
import numpy as np
import pytest

import tiny
from lowrl import sharding
from lowrl.training import loop, storage


def test_keep_and_use_place_copies_as_the_storage_says():
  plan = sharding.ShardingPlan(sharding.make_mesh((4, 2), ("data", "model")))
  x = plan.put(jnp.arange(32.0).reshape(8, 4) / 3, plan.named("data", "model"))
  tree = {"w": x, "step": plan.put(jnp.int32(3), plan.replicated)}
  kept = storage.keep(tree, "param")
  assert kept["w"] is not x and kept["w"].sharding == x.sharding
  np.testing.assert_array_equal(kept["w"], x)
  half = storage.keep(tree, "bfloat16")
  assert half["w"].dtype == jnp.bfloat16 and half["step"].dtype == jnp.int32
  np.testing.assert_array_equal(half["w"], x.astype(jnp.bfloat16))
  host = storage.keep(tree, "host")
  assert host["w"].sharding.memory_kind == "pinned_host"
  back = storage.use(host)
  assert back["w"].sharding.memory_kind == "device" and back["w"].sharding.spec == x.sharding.spec
  np.testing.assert_array_equal(back["w"], x)
  assert storage.use(None) is None
  with pytest.raises(ValueError, match="storage 'disk'"):
    storage.keep(tree, "disk")


def _metrics(workdir):
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    return [json.loads(line) for line in f]


def test_host_offloaded_reference_and_versions_give_the_same_run(tmp_path):
  base_dir = str(tmp_path / "base")
  runs = {}
  for where in ("param", "host", "bfloat16"):
    c = tiny.loop_config("fp32", base_dir, steps=3, num_prompts=2)
    c.model.n_layers = 1  # where the copies live does not depend on the depth: smaller programs
    c.rl.kl_coef, c.async_rl.lag = 0.1, 1  # a penalised reference and one stale version
    # Decay moves the weights every step, whatever the sampled rewards (a tiny base can score all
    # of a batch's groups alike, and then no gradient moves them): the reference and the stale
    # version really differ from the current weights.
    c.optimizer.weight_decay = 1.0
    c.rl.ref_storage = c.async_rl.version_storage = where
    loop.run(c, str(tmp_path / where), log=lambda _: None)
    runs[where] = _metrics(str(tmp_path / where))
  assert runs["host"] == runs["param"]  # the same numbers, bit for bit (checkpointed each step)
  assert all(m["drift/staleness/abs_dlogp_max"] > 0 for m in runs["param"][1:])
  # BF16 copies: the same run up to the rounded weights (a different, valid trajectory).
  assert [m["step"] for m in runs["bfloat16"]] == [1, 2, 3]
  assert runs["bfloat16"] != runs["param"]
