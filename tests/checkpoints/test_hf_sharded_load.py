"""`load_hf_params` onto a mesh: two processes (4 fake CPU devices each, jax.distributed) load a
sharded-index Qwen3 checkpoint onto one (4, 2) mesh with the default rules; each reads from the
files exactly the slices its own devices hold (every read recorded), each distinct slice once, and
every shard holds the checkpoint's values.

This file doubles as the worker: `python tests/checkpoints/test_hf_sharded_load.py CKPT OUT
COORDINATOR PROCESS_ID`.
"""
import json
import os
import re
import sys

import numpy as np

WORKER_DEVICES = 4  # per process: the (4, 2) mesh's "data" axis spans both processes


def _hf_name(path: str) -> tuple[str, bool]:
  """(Hugging Face tensor name, whether it is stored transposed) of a lowrl param path, written
  out from the transformers module names (independent of lowrl.checkpoints' table)."""
  fixed = {"embed/embedding": ("model.embed_tokens.weight", False),
           "final_norm/scale": ("model.norm.weight", False),
           "lm_head/kernel": ("lm_head.weight", True)}
  if path in fixed:
    return fixed[path]
  i, rest = re.fullmatch(r"layers_(\d+)/(.*)", path).groups()
  p = f"model.layers.{i}."
  norms = {"attn_norm/scale": "input_layernorm.weight",
           "mlp_norm/scale": "post_attention_layernorm.weight",
           "attn/q_norm/scale": "self_attn.q_norm.weight",
           "attn/k_norm/scale": "self_attn.k_norm.weight"}
  if rest in norms:
    return p + norms[rest], False
  block, proj, kind = rest.split("/")
  module = "self_attn" if block == "attn" else "mlp"
  return f"{p}{module}.{proj}.{'weight' if kind == 'kernel' else 'bias'}", kind == "kernel"


def _ranges(index, shape) -> list[list[int]]:
  """[[start, stop], ...] of a tuple of slices over `shape` (None bounds made explicit)."""
  index = tuple(index) + (slice(None),) * (len(shape) - len(index))
  return [[s.start or 0, dim if s.stop is None else s.stop] for s, dim in zip(index, shape)]


def _worker(ckpt: str, out: str, coordinator: str, process_id: int) -> None:
  import jax

  from lowrl import distributed, sharding
  from lowrl.checkpoints import hf, hf_config
  from lowrl.models import init

  distributed.initialize(coordinator, 2, process_id)
  reads = []
  open_file = hf._open

  class Slice:  # records every read of tensor data (headers are not data)
    def __init__(self, name, s):
      self.name, self.s = name, s

    def __getitem__(self, index):
      reads.append([self.name, _ranges(index, self.s.get_shape())])
      return self.s[index]

    def __getattr__(self, attr):
      return getattr(self.s, attr)

  class Handle:
    def __init__(self, fh):
      self.fh = fh

    def __enter__(self):
      self.inner = self.fh.__enter__()
      return self

    def __exit__(self, *exc):
      return self.fh.__exit__(*exc)

    def keys(self):
      return self.inner.keys()

    def get_slice(self, name):
      return Slice(name, self.inner.get_slice(name))

  hf._open = lambda file: Handle(open_file(file))
  model_cfg = hf_config.model_config_from_hf(hf_config.read_hf_config(ckpt))
  plan = sharding.ShardingPlan(sharding.make_mesh((4, 2), ("data", "model")))
  shapes = init.param_shapes(model_cfg)
  params = hf.load_hf_params(ckpt, model_cfg, shardings=plan.param_shardings(shapes))
  held = {}
  for kp, x in jax.tree_util.tree_flatten_with_path(params)[0]:
    path = "/".join(str(k.key) for k in kp)
    held[path] = [{"index": _ranges(s.index, x.shape), "data": np.asarray(s.data).tolist()}
                  for s in x.addressable_shards]
  with open(out, "w") as f:
    json.dump({"reads": reads, "held": held, "devices": len(jax.local_devices())}, f)


def test_each_process_reads_only_the_slices_its_devices_hold(tmp_path):
  import safetensors.numpy
  from hf_builders import write_checkpoint
  from multiprocess import free_port, run_processes

  ckpt, _ = write_checkpoint(tmp_path, "qwen3")  # 3 shards + index, FP32
  full = {}
  for name in os.listdir(ckpt):
    if name.endswith(".safetensors"):
      full.update(safetensors.numpy.load_file(os.path.join(ckpt, name)))
  coordinator = f"127.0.0.1:{free_port()}"
  outs = [str(tmp_path / f"p{i}.json") for i in range(2)]
  run_processes([[os.path.abspath(__file__), ckpt, outs[i], coordinator, str(i)]
                 for i in range(2)], WORKER_DEVICES, timeout=300)
  results = []
  for out in outs:
    with open(out) as f:
      results.append(json.load(f))

  partial = 0
  for r in results:
    assert r["devices"] == WORKER_DEVICES
    reads = [(name, tuple(map(tuple, rng))) for name, rng in r["reads"]]
    assert len(reads) == len(set(reads))  # a slice on several devices is read once
    want = set()
    for path, shards in r["held"].items():
      name, transposed = _hf_name(path)
      value = full[name].T if transposed else full[name]
      for s in shards:
        box = tuple(slice(a, b) for a, b in s["index"])
        np.testing.assert_array_equal(np.asarray(s["data"], np.float32), value[box], err_msg=path)
        hf_box = s["index"][::-1] if transposed else s["index"]
        want.add((name, tuple(map(tuple, hf_box))))
        partial += any(b - a < d for (a, b), d in zip(hf_box, full[name].shape))
    assert set(reads) == want  # exactly the slices this process's devices hold
  assert partial  # FSDP/tensor-parallel params: slices, not whole tensors
  # "data" spans both processes: they read different rows of an FSDP-sharded kernel.
  q = "model.layers.0.self_attn.q_proj.weight"
  by_process = [{str(rng) for name, rng in r["reads"] if name == q} for r in results]
  assert by_process[0] and by_process[1] and not by_process[0] & by_process[1]


if __name__ == "__main__":
  sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
  _worker(sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]))
