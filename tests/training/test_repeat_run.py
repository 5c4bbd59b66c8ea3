"""A repeat run of the training binary, with the compilation cache and the shared base a first run
left, gives byte for byte the first run's metrics.jsonl (lowrl.user_cache, base_store)."""
import os
import re
import subprocess
import sys


import multiprocess
import tiny

FLAGS = [
    "--config=configs/fp32.py",
    "--config.model.d_model=32", "--config.model.n_layers=2", "--config.model.n_heads=2",
    "--config.model.n_kv_heads=1", "--config.model.head_dim=16", "--config.model.d_ff=64",
    "--config.sft.steps=5", "--config.rl.steps=3", "--config.rl.num_prompts=4",
    "--config.rl.group_size=4", "--config.eval_num_prompts=8", "--config.eval_samples=1",
]


def _train(workdir, *flags) -> str:
  """The binary's stdout and stderr (JAX logs each compile and persistent-cache hit)."""
  env = multiprocess.child_env(1, PYTHONUNBUFFERED="1", JAX_LOG_COMPILES="1",
                              JAX_EXPLAIN_CACHE_MISSES="1")
  proc = subprocess.run([sys.executable, "-m", "experiments.train", f"--workdir={workdir}",
                         *FLAGS, *flags], cwd=str(tiny.REPO), env=env, capture_output=True,
                        text=True, timeout=600)
  assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
  return proc.stdout + proc.stderr


def _entries(cache: str) -> set[str]:
  """The keys of the cache's executables."""
  return {n[:-len("-cache")] for n in os.listdir(cache) if n.endswith("-cache")}


def test_cached_run_with_a_reused_base_is_byte_identical(tmp_path):
  cache, store = str(tmp_path / "jax"), str(tmp_path / "bases")
  flags = (f"--compile_cache={cache}", f"--config.sft.base_dir={store}")
  first = _train(tmp_path / "first", *flags)  # an empty cache: every program compiled
  assert "[sft] saved base" in first
  compiled = _entries(cache)
  assert compiled  # the programs that took 0.2 s or more to compile
  repeat = _train(tmp_path / "repeat", *flags)
  assert "[sft] reusing base" in repeat and "[sft] step" not in repeat
  # The repeat loaded what the first run cached (the SFT programs it no longer runs aside) and
  # compiled none of it again.
  def keys(what):
    return set(re.findall(rf"{what} for '[^']*' with key '([^']+)'", repeat))
  hits, misses = keys("Persistent compilation cache hit"), keys("PERSISTENT COMPILATION CACHE MISS")
  assert len(hits) >= len(compiled) // 2 and hits <= compiled and not misses & compiled
  with open(tmp_path / "first" / "metrics.jsonl", "rb") as f, \
      open(tmp_path / "repeat" / "metrics.jsonl", "rb") as g:
    assert f.read() == g.read()
