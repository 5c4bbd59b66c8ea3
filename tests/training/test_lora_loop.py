"""A LoRA run through the real loop (lowrl.training.loop.run) on a tiny config: the adapters
train, the base stays bit for bit, each sync after the first moves the adapters alone, and a run
interrupted after step 2 resumes to the uninterrupted run's metrics and adapters bit for bit."""
import json
import os
import sys

import jax
import numpy as np
import pytest
import tiny

from lowrl.models import lora
from lowrl.training import loop
from lowrl.training.setup import build
from lowrl.training.state import final_params

STEPS = 3


class _Crash(Exception):
  pass


def _quiet(_: str) -> None:
  pass


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory):
  return str(tmp_path_factory.mktemp("base"))


def lora_config(base_dir: str):
  # The async-loop test's base (one layer, 150 SFT steps: non-zero advantages), NVFP4 recipe
  # widths (blocks of 16), LoRA r = 4 on every linear layer.
  c = tiny.loop_config("nvfp4_recipe", base_dir, steps=STEPS, num_prompts=4, sft_steps=150,
                       sft_batch_size=64)
  c.model.update(dict(n_layers=1, d_model=64, n_heads=4, n_kv_heads=2, head_dim=16, d_ff=128))
  c.lora.update(dict(rank=4, alpha=8.0))
  c.optimizer.lr = 1e-3
  return c


def _metrics(workdir: str) -> list[dict]:
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    return [json.loads(line) for line in f]


@pytest.fixture(scope="module")
def lora_run(base_dir, tmp_path_factory):
  workdir = str(tmp_path_factory.mktemp("lora"))
  loop.run(lora_config(base_dir), workdir, log=_quiet)
  return workdir


def test_lora_run_trains_adapters_only_and_syncs_them(lora_run, base_dir):
  cfg = lora_config(base_dir)
  rows = _metrics(lora_run)
  assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
  assert all(r["refit/mismatched_tensors"] == 0.0 and r["mismatch/mismatch_kl"] == 0.0
             for r in rows)
  params = final_params(cfg, lora_run)
  base, adapters = lora.split(jax.tree.map(np.asarray, params))
  assert rows[0]["refit/sync_bytes"] > rows[1]["refit/sync_bytes"] == lora.tree_bytes(adapters)
  start = loop.load_base(cfg, lora_run, _quiet)
  for x, y in zip(jax.tree.leaves(base), jax.tree.leaves(start)):
    np.testing.assert_array_equal(np.asarray(x).view(np.uint8), np.asarray(y).view(np.uint8))
  b = [x for kp, x in jax.tree_util.tree_leaves_with_path(adapters) if kp[-1].key == lora.B]
  assert b and all(np.abs(x).max() > 0 for x in b)  # B left zero: the adapters trained
  # The checkpoints hold the adapters and their optimizer state, not the frozen base (the
  # leaves orbax's tree metadata lists under "params").
  with open(os.path.join(lora_run, "checkpoints", str(STEPS), "state", "_METADATA")) as f:
    keys = list(json.load(f)["tree_metadata"])
  params_keys = [k for k in keys if k.startswith("('params',")]
  assert len(params_keys) == len(jax.tree.leaves(adapters))
  assert all(k.endswith(("'lora_a')", "'lora_b')")) for k in params_keys)


def test_interrupted_lora_run_resumes_bit_identically(lora_run, base_dir, tmp_path):
  cfg = lora_config(base_dir)

  def crash_at_step_2(msg: str) -> None:
    if msg.startswith("[rl] step 2/"):
      raise _Crash

  with pytest.raises(_Crash):
    loop.run(cfg, str(tmp_path), log=crash_at_step_2)
  logs = []
  loop.run(cfg, str(tmp_path), log=logs.append)
  assert any(m.startswith("[resume] from step 1") for m in logs)
  got_rows, want_rows = _metrics(str(tmp_path)), _metrics(lora_run)
  # The resumed process's sampler starts empty: its first sync (step 2) moves the packed base
  # again; every other number is the uninterrupted run's.
  assert got_rows[1]["refit/sync_bytes"] == want_rows[0]["refit/sync_bytes"]
  drop = lambda rows: [{k: v for k, v in r.items() if k != "refit/sync_bytes"}  # noqa: E731
                       for r in rows]
  assert drop(got_rows) == drop(want_rows)
  got, want = final_params(cfg, str(tmp_path)), final_params(cfg, lora_run)
  for x, y in zip(jax.tree.leaves(lora.split(got)[1]), jax.tree.leaves(lora.split(want)[1])):
    np.testing.assert_array_equal(np.asarray(x).view(np.uint8), np.asarray(y).view(np.uint8))


def _packed_and_unpacked_runs(out: str) -> None:
  """The child process of test_packed_base_run_is_the_unpacked_run: the unpacked and the packed
  LoRA loop in `out`/unpacked and `out`/packed (one mid-trained base in `out`/base), and each
  run's final adapters in `<run>/adapters.npz` (named by their tree path)."""
  cfg = lora_config(os.path.join(out, "base"))
  cfg.model.n_layers = 2
  cfg.sft.steps = 30
  for packed in (False, True):
    cfg.lora.packed_base = packed
    workdir = os.path.join(out, "packed" if packed else "unpacked")
    loop.run(cfg, workdir, log=_quiet)
    adapters = lora.split(final_params(cfg, workdir))[1]
    np.savez(os.path.join(workdir, "adapters.npz"), **{
        jax.tree_util.keystr(kp): np.asarray(x)
        for kp, x in jax.tree_util.tree_leaves_with_path(adapters)})


def test_packed_base_run_is_the_unpacked_run(tmp_path):
  """--config.lora.packed_base: the loop (SFT base packed once at load) logs the unpacked LoRA
  run's metrics and ends with its adapters, bit for bit. Two layers: the recipe's first is NVFP4
  (its last stays BF16).

  Both runs go in one launched process that compiles every program with XLA:CPU's fusion
  emitters, as production does (LOWRL_TEST_FUSION_EMITTERS=1): the test workers compile programs
  without a sub-byte type with the elemental emitter (tests/fusion_emitters.py), which would put
  the packed update (E2M1 codes) and the unpacked one on different emitters, ulps apart from
  step 2. Its own process, not the worker's caches cleared: no executable of the worker's
  crosses into it."""
  import subprocess

  import multiprocess
  here = os.path.dirname(os.path.abspath(__file__))
  env = multiprocess.child_env(8, LOWRL_TEST_FUSION_EMITTERS="1")
  env["PYTHONPATH"] = os.pathsep.join([env["PYTHONPATH"], multiprocess.REPO,
                                       os.path.dirname(here)])
  proc = subprocess.run([sys.executable, os.path.abspath(__file__), str(tmp_path)],
                        cwd=multiprocess.REPO, env=env, capture_output=True, text=True,
                        timeout=900)
  assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
  unpacked, packed = str(tmp_path / "unpacked"), str(tmp_path / "packed")
  # The packed run logs no quant_error/* (no master weights to measure): the rest is equal.
  drop = lambda rows: [{k: v for k, v in r.items()  # noqa: E731
                        if not k.startswith("quant_error/")} for r in rows]
  assert not any(k.startswith("quant_error/") for r in _metrics(packed) for k in r)
  assert drop(_metrics(packed)) == drop(_metrics(unpacked))
  got, want = (np.load(os.path.join(d, "adapters.npz")) for d in (packed, unpacked))
  assert sorted(got.files) == sorted(want.files) and want.files
  for k in want.files:
    np.testing.assert_array_equal(got[k].view(np.uint8), want[k].view(np.uint8))
  # The adapters trained (B left zero), so the comparison is of trained values.
  assert all(np.abs(want[k]).max() > 0 for k in want.files if k.endswith(f"'{lora.B}']"))


def test_export_merged_and_peft(lora_run, base_dir, tmp_path):
  """experiments.export_hf of a LoRA run: merged kernels W + A B alpha / r by default, the
  adapters alone in PEFT's layout with --lora_format=peft (both read back exactly)."""
  from experiments import export_hf
  from lowrl.checkpoints import load_hf_checkpoint, peft_adapters
  cfg = lora_config(base_dir)
  params = jax.tree.map(np.asarray, final_params(cfg, lora_run))
  merged_dir, peft_dir = str(tmp_path / "merged"), str(tmp_path / "peft")
  export_hf.export(lora_run, merged_dir, log=_quiet)
  _, loaded = load_hf_checkpoint(merged_dir)
  want = lora.merged_kernels(params, cfg.lora.alpha / cfg.lora.rank)
  assert jax.tree.structure(loaded) == jax.tree.structure(want)
  for x, y in zip(jax.tree.leaves(loaded), jax.tree.leaves(want)):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
  export_hf.export(lora_run, peft_dir, lora_format="peft", log=_quiet)
  got_cfg, adapters = peft_adapters.load_adapters(peft_dir, build(cfg).model_cfg)
  assert (got_cfg.rank, got_cfg.alpha) == (4, 8.0)
  for x, y in zip(jax.tree.leaves(adapters), jax.tree.leaves(lora.split(params)[1])):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


if __name__ == "__main__":
  _packed_and_unpacked_runs(sys.argv[1])
