r"""Paired comparison (seeds shared): full fine-tuning vs LoRA on a BF16 base vs LoRA on the packed
NVFP4 base, with and without QeRL's adaptive quantization noise (AQN), on the main job.

  python -m experiments.lora_paired --workdir=/tmp/lowrl_lora_paired --seeds=0,1,2
  python -m experiments.lora_paired --workdir=W --seeds=0,1,2 --config.rl.steps=20 \
      --arms=full,lora_bf16,lora_nvfp4,lora_nvfp4_aqn

The base config is the main job (configs/default.py; `--config.*` overrides it for every arm).
Arms (each a function of that config, `ARMS`):
  full            the main job: every weight trained, nvfp4_recipe;
  lora_bf16       the base frozen, the BF16 recipe (`precision=bf16`), the adapters of
                  configs/lora_nvfp4.py (rank, alpha, lr);
  lora_nvfp4      configs/lora_nvfp4.py's adapters on the nvfp4_recipe base held packed;
  lora_nvfp4_aqn  lora_nvfp4 + AQN (`--aqn_sigma_start`, the schedule's other knobs as configured);
  lora_bf16_aqn   lora_bf16 + AQN.
A seed is the unit: every arm of seed s runs with `seed=s` (sampling, data order, the held-out
eval set, the adapters' init) from the same mid-trained base (`sft.seed=0`, stored once in
`<W>/bases`), so arm differences are paired by seed. One run at a time, each in `<W>/s<seed>/<arm>`
(a finished run is reused: the binary resumes).

Per run: held-out pass@1 gain (summary's eval_end - eval_start; the start is the base under the
arm's recipe, so the BF16 arm starts elsewhere) and its end value, the policy entropy of pi_old
on the batch's tokens at step 1 and averaged over the run's steps (and over its last quarter),
the sampler/trainer mismatch KL averaged over the steps, and the final train reward (mean of the
last quarter's steps). Report (`<W>/report.json` and stdout): per arm the per-seed values, and
per comparison (every arm vs full; lora_nvfp4 vs lora_bf16; each AQN arm vs its arm without AQN)
the paired differences' mean with a 95% Student t interval (lowrl.analysis.stats.paired_t).
"""
from __future__ import annotations

import copy
import json
import os
import time
from typing import Any

from absl import app, flags, logging
import ml_collections
import numpy as np

from configs import lora_nvfp4
from lowrl import precision
from lowrl.analysis import stats
from lowrl.training import cli, loop

# arm -> (BF16 recipe, LoRA adapters, packed base, AQN): changes to the main job's config.
ARMS: dict[str, tuple[bool, bool, bool, bool]] = {
    "full": (False, False, False, False),
    "lora_bf16": (True, True, False, False),
    "lora_nvfp4": (False, True, True, False),
    "lora_nvfp4_aqn": (False, True, True, True),
    "lora_bf16_aqn": (True, True, False, True),
}
# (treatment, baseline) pairs the report compares, when both arms ran.
COMPARISONS = [("lora_bf16", "full"), ("lora_nvfp4", "full"), ("lora_nvfp4_aqn", "full"),
               ("lora_bf16_aqn", "full"), ("lora_nvfp4", "lora_bf16"),
               ("lora_nvfp4_aqn", "lora_nvfp4"), ("lora_bf16_aqn", "lora_bf16")]
MEASURES = ("heldout_gain", "pass_at_1_end", "greedy_gain", "entropy_step1", "entropy_mean",
            "entropy_last_quarter", "mismatch_kl_mean", "train_reward_last_quarter")


def arm_config(base: ml_collections.ConfigDict, arm: str, seed: int, workdir: str,
               aqn_sigma_start: float) -> ml_collections.ConfigDict:
  """The run config of `arm` at `seed`: the base config, the arm's changes, the shared base."""
  bf16, adapters, packed, aqn = ARMS[arm]
  c = copy.deepcopy(base)
  if bf16:
    c.precision = precision.recipe("bf16")
  if adapters:  # configs/lora_nvfp4.py's adapters and learning rate
    ref = lora_nvfp4.get_config()
    c.lora.rank, c.lora.alpha, c.optimizer.lr = ref.lora.rank, ref.lora.alpha, ref.optimizer.lr
  c.lora.packed_base = packed
  if aqn:
    c.lora.aqn_sigma_start = aqn_sigma_start
  c.seed = seed
  c.sft.seed = 0  # one mid-trained base for every seed and arm
  c.sft.base_dir = os.path.join(workdir, "bases")
  return c


def measures(run_dir: str) -> dict[str, float]:
  """The run's measured values (MEASURES) from its summary.json and metrics.jsonl."""
  with open(os.path.join(run_dir, "summary.json")) as f:
    s = json.load(f)
  with open(os.path.join(run_dir, "metrics.jsonl")) as f:
    rows = [json.loads(line) for line in f]
  last = rows[-max(1, len(rows) // 4):]
  mean = lambda rs, k: float(np.mean([r[k] for r in rs]))  # noqa: E731
  return {
      "heldout_gain": s["eval_end"]["pass_at_1"] - s["eval_start"]["pass_at_1"],
      "greedy_gain": s["eval_end"]["greedy"] - s["eval_start"]["greedy"],
      "entropy_step1": rows[0]["entropy"],
      "entropy_mean": mean(rows, "entropy"),
      "entropy_last_quarter": mean(last, "entropy"),
      "mismatch_kl_mean": mean(rows, "mismatch/mismatch_kl"),
      "train_reward_last_quarter": mean(last, "reward/mean"),
      "pass_at_1_start": s["eval_start"]["pass_at_1"],
      "pass_at_1_end": s["eval_end"]["pass_at_1"],
      "wall_s": s.get("wall_s", float("nan")),
  }


def report(values: dict[str, dict[int, dict[str, float]]]) -> dict[str, Any]:
  """Per comparison and measure: the paired differences by seed and their t interval."""
  out: dict[str, Any] = {"arms": values, "comparisons": {}}
  for treat, base in COMPARISONS:
    if treat not in values or base not in values:
      continue
    comp = {}
    for m in MEASURES:
      seeds, d = stats.paired_diffs({s: v[m] for s, v in values[treat].items()},
                                    {s: v[m] for s, v in values[base].items()})
      r = stats.paired_t(d)
      comp[m] = dict(seeds=seeds, diffs=d.tolist(), n=r.n, mean=r.mean, ci_low=r.ci_low,
                     ci_high=r.ci_high, p=r.p)
    out["comparisons"][f"{treat} - {base}"] = comp
  return out


def print_report(rep: dict[str, Any]) -> None:
  for arm, by_seed in rep["arms"].items():
    for m in ("pass_at_1_start", *MEASURES, "wall_s"):
      print(f"{arm:16s} {m:26s} " + " ".join(f"s{s}={v[m]:.4f}" for s, v in by_seed.items()))
  print("| comparison | measure | n | mean difference | 95% t interval | p |")
  print("|---|---|---|---|---|---|")
  for name, comp in rep["comparisons"].items():
    for m, r in comp.items():
      print(f"| {name} | {m} | {r['n']} | {r['mean']:+.4f} | "
            f"[{r['ci_low']:+.4f}, {r['ci_high']:+.4f}] | {r['p']:.3g} |")


def main(argv):
  base = _FLAGS.start(argv)
  if base is None:
    return
  logging.set_verbosity(logging.WARNING)  # orbax logs every save at INFO
  workdir = os.path.abspath(_FLAGS.workdir.value)
  unknown = [a for a in _ARMS.value if a not in ARMS]
  if unknown:
    cli.fail(f"--arms: unknown {unknown}; choose from {list(ARMS)}.")
  seeds = [int(s) for s in _SEEDS.value]
  values: dict[str, dict[int, dict[str, float]]] = {}
  for seed in seeds:
    for arm in _ARMS.value:
      run_dir = os.path.join(workdir, f"s{seed}", arm)
      done = os.path.exists(os.path.join(run_dir, "summary.json"))
      if not done and not _REPORT_ONLY.value:
        t0 = time.time()
        print(f"[lora_paired] seed {seed} arm {arm} -> {run_dir}", flush=True)
        loop.run(arm_config(base, arm, seed, workdir, _AQN.value), run_dir,
                 log=lambda m: print(m, flush=True))
        print(f"[lora_paired] seed {seed} arm {arm} done in {time.time() - t0:.0f} s", flush=True)
      if os.path.exists(os.path.join(run_dir, "summary.json")):
        values.setdefault(arm, {})[seed] = measures(run_dir)
  rep = report(values)
  with open(os.path.join(workdir, "report.json"), "w") as f:
    json.dump(rep, f, indent=1)
  print_report(rep)


if __name__ == "__main__":
  # Flags only when run as the binary: a test importing this module beside another binary's
  # (both define --workdir) must not collide in absl's global registry.
  _FLAGS = cli.define_run_flags("default.py", "/tmp/lowrl_lora_paired",
                                "Experiment directory (the base store, one run per seed and arm).")
  _SEEDS = flags.DEFINE_list("seeds", ["0", "1", "2"], "Run seeds (the paired units).")
  _ARMS = flags.DEFINE_list("arms", ["full", "lora_bf16", "lora_nvfp4", "lora_nvfp4_aqn"],
                            "Arms to run, in this order within each seed.")
  _AQN = flags.DEFINE_float("aqn_sigma_start", 1e-2, "AQN arms: lora.aqn_sigma_start.")
  _REPORT_ONLY = flags.DEFINE_bool("report_only", False, "Report the finished runs; run nothing.")
  app.run(main, flags_parser=_FLAGS.parser())
