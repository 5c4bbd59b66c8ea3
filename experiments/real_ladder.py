r"""The recipe's paired designs (experiments/paired.py) on a real checkpoint: the forward ladder,
then the backward modes and the code churn of one update.

  python -m experiments.real_ladder --config=configs/smollm2.py --batches=2 --out=/tmp/ladder.json
  python -m experiments.real_ladder --config=configs/smollm2.py --config.rl.num_prompts=4 \
      --batches=20 --grad_batches=20 --heldout=2 --out=/tmp/paired.json

`--batches` rollout batches (the config's rl.num_prompts x rl.group_size, training prompts of
steps 0, 1, ...) are sampled once from the checkpoint in BF16 (the ablation grid's `bf16`
setting, configs/ablate.py, applied to this config).

forward ladder  every rung of paired.LADDER (nvfp4_naive -> +per_token -> +4/6 -> +bf16_tail,
                configs/ablate.py's precisions) scores the same tokens with the same weights;
                `paired.forward_ladder` gives per prompt the exact full-vocabulary KL(rung || BF16)
                averaged over its completions' positions. Printed: each rung's mean, and each step
                of the ladder as a paired difference over prompts (lowrl.analysis: mean with its t
                interval, sign-test p), and the same difference with the batch as the unit (the
                mean over a batch's prompts, a t interval over batches: prompts sampled in one
                batch share its key and compile, so this interval allows them to be correlated).
backward        on the first `--grad_batches` of those batches, `paired.backward` unchanged (the
                recipe's forward with each backward mode against the FP32 gradient and against
                the dequantized backward's; one AdamW step per mode and the held-out surrogate's
                change on `--heldout` batches sampled in BF16 from training steps 10000, ...;
                the code churn of that step under the recipe and every ladder rung), run in
                chunks of `--chunk` batches so that each chunk's numbers reach `--out` as it ends;
                `--resume --noladder` (the same command otherwise) keeps the chunks a stopped
                run left in `--out`, samples only the batches still to run, and goes on.

Runs on the host CPU (JAX_PLATFORMS=cpu unless set). `--trim_heap_s`: glibc keeps the pages the
30-layer programs' compiles and runs free inside its arenas, and on SmolLM2 the backward design's
RSS grew past 13.5 GB with ~2 GB of them (one malloc_trim(0) returned 2.0 GB at once); a thread
hands them back to the OS every that many seconds (docs/real_model.md). It changes no value.
"""
import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import ctypes  # noqa: E402
import ctypes.util  # noqa: E402
import json  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402
from typing import Callable  # noqa: E402

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from absl import app, flags  # noqa: E402
from ml_collections import config_flags  # noqa: E402

from configs import ablate as ablate_config  # noqa: E402
from experiments import paired  # noqa: E402
from lowrl import user_cache  # noqa: E402
from lowrl.analysis import stats  # noqa: E402
from lowrl.checkpoints import hf  # noqa: E402
from lowrl.training.setup import build  # noqa: E402
from lowrl.training.trainer import Trainer  # noqa: E402


def step_summary(kl: dict[str, list[float]], batches: int) -> dict[str, dict[str, float]]:
  """Each step of the ladder as a paired difference: by prompt (t interval, sign test) and by
  batch (the mean over each batch's prompts, consecutive and equal in number; t interval)."""
  n = len(kl[paired.LADDER[0]])
  if batches < 2 or n % batches:
    raise ValueError(f"step_summary: {n} prompts do not split into {batches} equal batches (>= 2)")
  out = {}
  for a, b in zip(paired.LADDER[:-1], paired.LADDER[1:]):
    diffs = np.asarray(kl[b]) - np.asarray(kl[a])
    t = stats.paired_t(diffs)
    tb = stats.paired_t(diffs.reshape(batches, -1).mean(1))
    out[f"{a} -> {b}"] = {
        "mean": t.mean, "ci_low": t.ci_low, "ci_high": t.ci_high, "p_t": t.p,
        "p_sign": stats.sign_test(diffs), "lower": int((diffs < 0).sum()),
        "prompts": int(diffs.size), "batches": batches, "batch_ci_low": tb.ci_low,
        "batch_ci_high": tb.ci_high, "batch_p_t": tb.p}
  return out


def trim_heap_loop(stop: threading.Event, seconds: float, trim: Callable[[], object]) -> None:
  """Calls `trim` every `seconds` until `stop` is set (the body of the heap-trimming thread)."""
  while not stop.wait(seconds):
    trim()


def start_heap_trimmer(seconds: float) -> threading.Event | None:
  """A daemon thread that calls glibc's malloc_trim(0) every `seconds` (returning the free pages
  of every arena to the OS); set the returned event to stop it. None when `seconds` <= 0 or the C
  library has no malloc_trim (not glibc)."""
  name = ctypes.util.find_library("c")
  libc = ctypes.CDLL(name) if name else None
  if seconds <= 0 or libc is None or not hasattr(libc, "malloc_trim"):
    return None
  stop = threading.Event()
  threading.Thread(target=trim_heap_loop, args=(stop, seconds, lambda: libc.malloc_trim(0)),
                   daemon=True, name="malloc_trim").start()
  return stop


def main(argv):
  del argv
  start = time.time()
  if not 0 <= _GRAD_BATCHES.value <= _BATCHES.value or _HELDOUT.value < 1 or _CHUNK.value < 1:
    raise app.UsageError("need 0 <= --grad_batches <= --batches, --heldout >= 1, --chunk >= 1")
  start_heap_trimmer(_TRIM_HEAP_S.value)
  user_cache.enable_compile_cache()
  grid = ablate_config.get_config()
  grid.run = _CONFIG.value
  settings = paired.all_settings(grid)
  seed = int(grid.seeds[0])
  setups = {name: build(settings[name].config(grid.run, seed))
            for name in ("bf16", *paired.LADDER)}
  bwd = paired._backward_setups(grid, settings, "") if _GRAD_BATCHES.value else {}  # noqa: SLF001
  twin = setups["bf16"]
  done = resumed_backward(_OUT.value, _GRAD_BATCHES.value, _CHUNK.value) if _RESUME.value else None
  if done is not None and _LADDER.value:
    raise app.UsageError("--resume continues the backward design only: add --noladder")
  first = done_batches(done)
  params = hf.load_hf_params(twin.base.hf_checkpoint, twin.model_cfg, dtype=jnp.float32)
  trainer = Trainer(twin, log=lambda _: None)
  # Batch s is a function of its step alone (paired.sample_batches), so a resumed run samples only
  # the batches it has still to run.
  rollouts = paired.sample_batches(trainer, params, _BATCHES.value - first, first_step=first)
  result = {"seconds": {"sample": time.time() - start}}
  if done is not None:  # kept in --out until the next chunk is merged with it
    result.update(backward=done, resumed_after_batches=first)
  print(f"[ladder] sampled {len(rollouts)} batches in BF16 ({time.time() - start:.0f}s)")

  def save():
    if _OUT.value:
      with open(_OUT.value, "w") as fh:
        json.dump({**result, "total_seconds": time.time() - start}, fh, indent=1)

  if _LADDER.value:
    t0 = time.time()
    ladder = paired.forward_ladder(grid, setups, twin, params, rollouts, log=print)
    kl = ladder["kl"]
    result.update(ladder, prompts=len(kl[paired.LADDER[0]]), batches=_BATCHES.value,
                  steps=step_summary(kl, _BATCHES.value))
    result["seconds"]["ladder"] = time.time() - t0
    for name, s in result["steps"].items():
      print(f"[ladder] {name}: mean change {s['mean']:+.4f} (95% CI by prompt {s['ci_low']:+.4f} "
            f".. {s['ci_high']:+.4f}, by batch {s['batch_ci_low']:+.4f} .. "
            f"{s['batch_ci_high']:+.4f}), sign test p {s['p_sign']:.3g}, "
            f"{s['lower']}/{s['prompts']} prompts lower")
  save()
  if _GRAD_BATCHES.value:
    t0 = time.time()
    heldout = paired.sample_batches(trainer, params, _HELDOUT.value, first_step=10_000)
    forwards = {**{n: setups[n] for n in paired.LADDER}, "nvfp4_recipe": bwd["dequantized"]}
    grad_rollouts = rollouts[:_GRAD_BATCHES.value - first]
    parts = [done] if done is not None else []
    for i in range(0, len(grad_rollouts), _CHUNK.value):
      parts.append(paired.backward(grid, bwd, params, grad_rollouts[i:i + _CHUNK.value],
                                   heldout, print, forwards=forwards))
      result["backward"] = merge_backward(parts)
      result["seconds"]["backward"] = time.time() - t0
      save()
  print(f"[ladder] done in {time.time() - start:.0f}s")
  result["total_seconds"] = time.time() - start
  save()


def done_batches(backward: dict | None) -> int:
  """How many batches a (merged) backward result holds (0 for None)."""
  return len(backward["modes"]["dequantized"]["cos_fp32"]) if backward else 0


def resumed_backward(out: str, grad_batches: int, chunk: int) -> dict | None:
  """The backward result an earlier run of the same command left in `out` (None if it has none):
  its whole chunks are kept and the run goes on with the next one. Each chunk is one call of
  `paired.backward` on its own batches (keys by position in the chunk), so a resumed chunk is the
  one the uninterrupted run would have computed."""
  if not out or not os.path.exists(out):
    return None
  with open(out) as fh:
    backward = json.load(fh).get("backward")
  n = done_batches(backward)
  if n % chunk or n > grad_batches:
    raise ValueError(f"--resume: {out} holds {n} batches, not whole chunks of --chunk={chunk} "
                     f"within --grad_batches={grad_batches}: rerun with the first run's flags")
  return backward


def merge_backward(parts: list[dict]) -> dict:
  """`paired.backward`'s per-batch lists of several chunks, concatenated in batch order (every
  chunk starts from the same weights and held-out batches, so their base loss is one number; a
  chunk whose base differs is refused)."""
  first = parts[0]
  bases = {p["heldout_base"] for p in parts}
  if len(bases) > 1:
    raise ValueError(f"merge_backward: chunks disagree on the held-out base loss {sorted(bases)}")
  modes = {m: {k: [x for p in parts for x in p["modes"][m][k]] for k in rows}
           for m, rows in first["modes"].items()}
  out = {"units": "batches", "heldout_base": first["heldout_base"], "modes": modes}
  if "churn_by_forward" in first:
    out["churn_by_forward"] = {
        f: {k: [x for p in parts for x in p["churn_by_forward"][f][k]] for k in v}
        for f, v in first["churn_by_forward"].items()}
  return out


# Flags only when run as a binary: the tests import step_summary and merge_backward beside other
# experiments whose flags share these names.
if __name__ == "__main__":
  _CONFIG = config_flags.DEFINE_config_file("config", "configs/smollm2.py")
  _BATCHES = flags.DEFINE_integer("batches", 2, "rollout batches sampled in BF16")
  _GRAD_BATCHES = flags.DEFINE_integer("grad_batches", 0,
                                       "of those, how many the backward design uses (0 = none)")
  _HELDOUT = flags.DEFINE_integer("heldout", 2, "held-out batches of the backward design")
  _CHUNK = flags.DEFINE_integer("chunk", 5, "backward batches per chunk (a JSON write after each)")
  _OUT = flags.DEFINE_string("out", "", "JSON file for the results ('' = print only)")
  _LADDER = flags.DEFINE_bool("ladder", True, "run the forward ladder (--noladder: backward only, "
                              "on the same deterministic batches)")
  _RESUME = flags.DEFINE_bool("resume", False, "keep the backward chunks that --out already holds "
                              "(from the same command, stopped) and run the rest (needs --noladder)")
  _TRIM_HEAP_S = flags.DEFINE_float("trim_heap_s", 30.0, "seconds between malloc_trim(0) calls "
                                    "that return glibc's free pages to the OS (0 = never)")
  app.run(main)
