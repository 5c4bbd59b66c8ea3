r"""The recipe ablation: a grid of settings of the real training loop, several seeds each.

  python -m experiments.ablate --workdir=/tmp/lowrl_ablate                     # configs/ablate.py
  python -m experiments.ablate --workdir=/tmp/lowrl_ablate_quick --config.quick=True   # ~11 min
  python -m experiments.report --workdir=/tmp/lowrl_ablate                     # docs/results.md

Every run is `lowrl.training.loop.run` (what experiments/train.py runs) on a config of its own,
all from one mid-trained base (`<workdir>/base`, trained once: `run.sft.seed` fixes its seed for
every run seed). Settings (`settings`), by group:
  recipe        sampler = trainer in one recipe: fp32, bf16, fp16 (static loss scale), mxfp8,
                nvfp4_naive, then the 4-bitter recipe built up one component at a time
                (+ per-token activation scale, + 4/6, + last 15% of layers BF16, + dequantized
                backward = nvfp4_recipe) and nvfp4_recipe with quantized backward;
  sampler_only  the trainer in BF16, the sampler in mxfp8 / nvfp4_naive / nvfp4_recipe;
  sr            at each learning rate of `lrs`: the seed's arm (rl.steps raised so that lr x
                steps reaches `sr_travel`), BF16 compute with FP32 master weights and the compute
                cast rounded to nearest (fp32_master) or stochastically (bf16_sr_cast,
                optimizer.compute_cast_rounding) and FP16 compute (FP32 master, static loss
                scale); and BF16 master weights rounded to nearest / stochastically after each
                update (bf16_rtn, bf16_sr; run.rl.steps);
  kl_reset      BF16 with a KL penalty (kl_coef) to the base, without and with resetting the
                reference every `ref_reset_every` steps.
A run's workdir is `<workdir>/runs/<config fingerprint>`: two settings with the same config (e.g.
fp16 at the default lr in two groups) share one run. Each finished (setting, seed) adds a line to
`<workdir>/results.jsonl` (eval start/end, summaries of metrics.jsonl, the twin KL, wall time);
an interrupted grid started again skips the lines it has (and the loop resumes a half-finished run
from its checkpoint); a line whose config changed since is an error, not a silent mix.

Distance to the BF16 twin (the "tracks BF16 dynamics" claim): after a run finishes, its final
policy (trainer precision) is compared with the final policy of the `twin` setting of the same
seed (same base, prompts, sampling keys) by KL(run || twin) per completion token on the held-out
prompts (`Trainer.policy_kl`: completions sampled from the run's policy, both policies score
them); `twin_kl_start` is the same between the two precisions' views of the base (quantization
alone). Computed from the two runs' final checkpoints, so no run trains a second model. Each line
also holds held-out pass@k (k = 1, 2, 4, ... up to eval_samples) of the base and of the final
policy (`pass_at_k_start` / `pass_at_k_end`).

The grid is data (configs/ablate.py GRID) and runs on lowrl.grid (one resumable runner). The
paired forward-only and backward measurements on the same base: experiments/paired.py.
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
import sys
import time
from typing import Any, Callable

import jax
import ml_collections
import numpy as np

from lowrl import grid as lowrl_grid
from lowrl import precision, user_cache
from lowrl.tasks import eval as eval_tasks
from lowrl.training import loop, optimizer, run_config, run_logs
from lowrl.training.setup import build
from lowrl.training.state import final_params
from lowrl.training.trainer import Trainer

Log = Callable[[str], None]
RESULTS = "results.jsonl"
GRID = "grid.json"  # the grid's command, seeds and settings (for the report)
TAIL = 0.2  # "final" training reward = mean over the last 20% of the steps
QUICK_SFT_STEPS = 100  # the quick grid's base: configs/ablate.py's own SFT length


@dataclasses.dataclass(frozen=True)
class Setting:
  """One point of the grid: a trainer precision (a PRECISION dict), a sampler recipe ('' = the
  trainer's) and further `--config.run.*` values ((flag, value), ...)."""

  name: str
  group: str
  precision: tuple[tuple[str, Any], ...]
  sampler: str = ""
  overrides: tuple[tuple[str, Any], ...] = ()
  first_seeds: int = 0  # > 0: the setting runs only the first this many of the grid's seeds

  def seeds(self, grid_seeds: tuple[int, ...]) -> tuple[int, ...]:
    """The seeds this setting runs, of the grid's `grid_seeds`."""
    return tuple(grid_seeds[:self.first_seeds] if self.first_seeds else grid_seeds)

  def config(self, run: ml_collections.ConfigDict, seed: int) -> ml_collections.ConfigDict:
    """The loop config of this setting and `seed` (`run` is left unchanged)."""
    c = ml_collections.ConfigDict(run.to_dict())
    c.precision = ml_collections.ConfigDict(dict(self.precision))
    c.sampler_precision.recipe = self.sampler
    c.seed = seed
    for flag, value in self.overrides:
      *parents, leaf = flag.split(".")
      node = c
      for p in parents:
        node = node[p]
      node[leaf] = value
    return c


def _recipe(name: str, label: str | None = None, **changes: Any) -> tuple[tuple[str, Any], ...]:
  p = precision.recipe(name).to_dict()
  unknown = set(changes) - set(p)
  if unknown:
    raise ValueError(f"unknown precision knobs {sorted(unknown)}")
  p.update(changes, name=label or name)
  return tuple(sorted(p.items()))


def _lr_tag(lr: float) -> str:
  return f"{lr:.0e}".replace("e-0", "e-")


def _value(cfg: ml_collections.ConfigDict, v: Any, row: str) -> Any:
  """An override value of a row: "$knob" is the grid config's top-level knob."""
  if isinstance(v, str) and v.startswith("$"):
    if v[1:] not in cfg:
      raise run_config.ConfigError(f"row {row}: {v} names no knob of the grid config; use one "
                                   f"of {sorted(k for k in cfg if k not in ('run', 'grid'))}.")
    v = cfg[v[1:]]
  return v


def _settings_of_row(cfg: ml_collections.ConfigDict, row: dict[str, Any]) -> list[Setting]:
  """The Setting(s) of one row of `cfg.grid` (configs/ablate.py GRID says how a row applies)."""
  known = {"name", "group", "overrides", "each", "min_travel", "first_seeds"}
  ov = dict(row.get("overrides", {}))
  if set(row) - known or not {"name", "group"} <= set(row) or "precision" not in ov:
    raise run_config.ConfigError(f"--config.grid: row {row!r} needs name, group and overrides "
                                 "with a 'precision' recipe, and may have only "
                                 f"{sorted(known)}.")
  name = row["name"]
  recipe = _value(cfg, ov.pop("precision"), name)
  label = ov.pop("precision.name", None)
  changes = {k.split(".", 1)[1]: _value(cfg, ov.pop(k), name)
             for k in [k for k in ov if k.startswith("precision.")]}
  sampler = _value(cfg, ov.pop("sampler_precision.recipe", ""), name)
  try:
    prec = _recipe(recipe, label, **changes)
  except (ValueError, KeyError) as e:
    raise run_config.ConfigError(f"--config.grid: row {name}: {e}") from e
  overrides = tuple((k, _value(cfg, v, name)) for k, v in ov.items())
  first = _value(cfg, row.get("first_seeds", 0), name)
  if not isinstance(first, int) or isinstance(first, bool) or first < 0:
    raise run_config.ConfigError(f"--config.grid: row {name}: first_seeds={first!r}; use an int "
                                 ">= 1 (the first that many of --config.seeds), or 0 for all.")
  if not row.get("each"):
    return [Setting(name, row["group"], prec, sampler, overrides, first)]
  if row["each"] != "lrs":
    raise run_config.ConfigError(f"--config.grid: row {name}: each={row['each']!r}; only "
                                 "'lrs' is known.")
  travel = float(_value(cfg, row.get("min_travel", 0.0), name))
  out = []
  for lr in cfg.lrs:
    steps = max(int(cfg.run.rl.steps), math.ceil(travel / float(lr) - 1e-9))
    more = (("rl.steps", steps),) if steps > cfg.run.rl.steps else ()
    out.append(Setting(f"{name}@{_lr_tag(lr)}", row["group"], prec, sampler,
                       (("optimizer.lr", float(lr)),) + more + overrides, first))
  return out


def settings(cfg: ml_collections.ConfigDict) -> list[Setting]:
  """The grid of `cfg` (configs/ablate.py `grid`), the `twin` setting first; only `cfg.groups`.
  Within a group the rows repeated over `lrs` come after the others, learning rate by learning
  rate (all of one lr together)."""
  groups: dict[str, list[Setting]] = {}
  for row in cfg.grid:
    groups.setdefault(row["group"], [])
  for g in groups:
    rows = [r for r in cfg.grid if r["group"] == g]
    once = [s for r in rows if not r.get("each") for s in _settings_of_row(cfg, r)]
    each = [_settings_of_row(cfg, r) for r in rows if r.get("each")]
    groups[g] = once + [s for per_lr in zip(*each) for s in per_lr]
  unknown = set(cfg.groups) - set(groups)
  if unknown:
    raise run_config.ConfigError(f"--config.groups: unknown groups {sorted(unknown)}; use some of "
                     f"{sorted(groups)}.")
  chosen = [s for g in groups if g in cfg.groups for s in groups[g]]
  if cfg.get("only"):
    chosen = [s for s in chosen if s.name in cfg.only]
  every = {s.name: s for g in groups.values() for s in g}
  if cfg.twin not in every:
    raise run_config.ConfigError(f"--config.twin={cfg.twin!r} is not a setting; use one of {sorted(every)}.")
  chosen = [every[cfg.twin]] + [s for s in chosen if s.name != cfg.twin]
  if not chosen:
    raise run_config.ConfigError("the grid is empty: check --config.groups / --config.only.")
  if chosen[0].first_seeds:
    # Every run is compared with the twin of its own seed, so the twin runs every seed.
    raise run_config.ConfigError(f"--config.twin={cfg.twin!r} has first_seeds="
                                 f"{chosen[0].first_seeds}: the twin must run every seed; drop "
                                 "first_seeds from its row or choose another twin.")
  return chosen


def quick(cfg: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
  """The small grid of `--config.quick=True`: one setting of every group (the sr group at the
  lowest of `lrs`), 2 seeds, the grid's model, a base of at most QUICK_SFT_STEPS SFT steps,
  8 RL steps of 8 prompts x 4. Its eval has as many rows as a rollout
  (16 prompts x 2 samples = 8 x 4), so evaluation and the twin KL run the rollout's sampling and
  scoring programs instead of compiling their own."""
  c = ml_collections.ConfigDict(cfg.to_dict())
  c.seeds = (0, 1)
  c.lrs = (min(cfg.lrs),)
  # One setting of every group the grid runs, besides the twin: each setting's first seed is
  # mostly compiling (75-140 s), so the quick grid's length is its number of settings.
  picks = {"recipe": "nvfp4_recipe", "sampler_only": "s=nvfp4_recipe/t=bf16",
           "sr": f"bf16_sr_cast@{_lr_tag(min(cfg.lrs))}", "kl_reset": "kl+reset"}
  c.only = tuple(n for g, n in picks.items() if g in c.groups)
  c.sr_travel = 0.0  # every run 8 steps
  c.ref_reset_every = 4
  r = c.run
  r.rl.update(steps=8, num_prompts=8, group_size=4)
  # A base of at most QUICK_SFT_STEPS (the regime's 1000 SFT steps at d = 256 alone take longer
  # than the quick grid may): the same code path, a weaker base.
  r.sft.steps = min(int(r.sft.steps), QUICK_SFT_STEPS)
  r.eval_num_prompts = 16
  r.eval_samples = 2
  r.diagnostics.every = 4
  r.checkpoint_every = 8
  return c


def validate(cfg: ml_collections.ConfigDict) -> list[tuple[Setting, ml_collections.ConfigDict]]:
  """Every (setting, seed config) of the grid, each checked by the loop's `build` (raises
  run_config.ConfigError naming the flag) before anything runs."""
  seeds = tuple(int(s) for s in cfg.seeds)
  if not seeds or len(set(seeds)) != len(seeds):
    raise run_config.ConfigError(f"--config.seeds={cfg.seeds!r}: distinct ints, at least one.")
  unknown = set(cfg.after_run) - set(AFTER_RUN)
  if unknown:
    raise run_config.ConfigError(f"--config.after_run={tuple(cfg.after_run)!r}: unknown "
                                 f"{sorted(unknown)}; choose from {AFTER_RUN}.")
  out = []
  for s in settings(cfg):
    c = s.config(cfg.run, seeds[0])
    try:
      build(c)
    except ValueError as e:
      raise run_config.ConfigError(f"setting {s.name}: {e}".replace("--config.",
                                                                    "--config.run.")) from e
    out.append((s, c))
  return out


def read_results(workdir: str) -> list[dict[str, Any]]:
  """The lines of `<workdir>/results.jsonl` (a line cut short by a kill is dropped)."""
  return lowrl_grid.read_results(os.path.join(workdir, RESULTS))


def summarize_metrics(lines: list[dict[str, Any]]) -> dict[str, float | None]:
  """Per-run numbers from metrics.jsonl lines: final training reward (mean of the last 20% of
  steps), and means over the steps of mismatch k1/k3/ESS, KL to the reference, and of the probe
  steps' gradient cosine / relative error and update erasure (None when never logged)."""
  def mean(key, rows=lines):
    vals = [r[key] for r in rows if r.get(key) is not None]
    return float(np.mean(vals)) if vals else None
  tail = lines[-max(1, int(round(len(lines) * TAIL))):]
  return {"final_reward": mean("reward/mean", tail),
          "mismatch_kl": mean("mismatch/mismatch_kl"),
          "mismatch_kl_k3": mean("mismatch/mismatch_kl_k3"),
          "ess": mean("mismatch/ess"), "kl_ref": mean("kl_ref"),
          "grad_cos": mean("grad_bias/cos/total"), "grad_rel_err": mean("grad_bias/rel_err/total"),
          "update_erasure": mean("update_erasure")}


def _pass_at_k(trainer: Trainer, params, key: jax.Array) -> dict[str, float]:
  """pass@k on the held-out prompts for k = 1, 2, 4, ... up to `eval_samples` (the unbiased
  estimate from `eval_samples` samples per prompt at the rollout temperature, trainer policy)."""
  tp = trainer.setup.trainer_policy
  n = int(trainer.setup.loop.eval_samples)
  chunks = trainer._eval_samples(params, key, quant_key=tp.quant_key(key),  # noqa: SLF001
                                 act_amax=trainer.act_amax(params, tp))
  rewards = np.concatenate([trainer.rewards(out, ex)[0] for out, ex in chunks]).reshape(-1, n)
  ks = sorted({k for k in (1, 2, 4, 8, 16, 32, 64) if k <= n} | {n})
  return {str(k): eval_tasks.pass_at_k_from_rewards(rewards, k) for k in ks}


AFTER_RUN = ("twin_kl", "pass_at_k")  # the after-run measurements a grid may ask for


def _after_run(cfg: ml_collections.ConfigDict, workdir: str, twin_cfg: ml_collections.ConfigDict,
               twin_dir: str, base, ref_kl: bool = False,
               measure: tuple[str, ...] = AFTER_RUN) -> dict[str, Any]:
  """The held-out measurements `measure` names: "twin_kl", KL(run || twin) of the final policies
  and of the base under both precisions; "pass_at_k", pass@k of the base and the final policy. `ref_kl`: also
  KL(final policy || base), both under the run's trainer precision (`ref_kl_end`, k1 and k3: how
  far training moved the policy from the reference, measured as the twin KL is). Each held-out
  pass costs as much sampling as eval_num_prompts x eval_samples / batch rows RL steps."""
  trainer = Trainer(build(cfg), log=lambda _: None)
  key = jax.random.key(cfg.seed)
  start_params = trainer.place(optimizer.to_master(base, cfg.optimizer.master_dtype))
  end_params = final_params(cfg, workdir, trainer)
  out = {}
  if "twin_kl" in measure:
    twin = Trainer(build(twin_cfg), log=lambda _: None)
    start = trainer.policy_kl(start_params, trainer.place(base), twin.setup.trainer_policy, key)
    end = trainer.policy_kl(end_params, final_params(twin_cfg, twin_dir, twin),
                            twin.setup.trainer_policy, key)
    out.update(twin_kl_start=start["kl"], twin_kl_k3_start=start["kl_k3"],
               twin_kl_end=end["kl"], twin_kl_k3_end=end["kl_k3"])
  if "pass_at_k" in measure:
    k_pass = jax.random.fold_in(key, 7)
    out.update(pass_at_k_start=_pass_at_k(trainer, start_params, k_pass),
               pass_at_k_end=_pass_at_k(trainer, end_params, k_pass))
  if ref_kl:
    ref = trainer.policy_kl(end_params, start_params, trainer.setup.trainer_policy, key)
    out.update(ref_kl_end=ref["kl"], ref_kl_k3_end=ref["kl_k3"])
  return out


def run_grid(cfg: ml_collections.ConfigDict, workdir: str, log: Log = print,
             command: str = "") -> list[dict]:
  """Runs (or resumes) the grid of `cfg` in `workdir`; returns the results lines. `command`
  (the command line) is recorded in `<workdir>/grid.json` for the report."""
  if cfg.quick:
    cfg = quick(cfg)
  grid = validate(cfg)
  seeds = tuple(int(s) for s in cfg.seeds)
  os.makedirs(workdir, exist_ok=True)
  with open(os.path.join(workdir, GRID), "w") as f:
    json.dump({"command": command or f"python -m experiments.ablate --workdir={workdir}",
               "quick": bool(cfg.quick),
               "seeds": list(seeds), "settings": [s.name for s, _ in grid],
               "setting_seeds": {s.name: list(s.seeds(seeds)) for s, _ in grid},
               "machine": f"{os.cpu_count()} CPU cores, {jax.default_backend()}"}, f)
  # The binaries' compilation cache (--compile_cache; a cache the caller set up is kept): seeds,
  # settings sharing programs and later grids reuse compiles.
  user_cache.enable_compile_cache()
  twin_setting = grid[0][0]
  base_dir = os.path.join(workdir, "base")
  jobs_of = [(s, seed) for s, _ in grid for seed in s.seeds(seeds)]
  log(f"[ablate] {len(grid)} settings, {len(jobs_of)} runs (seeds {list(seeds)}) in {workdir}; "
      f"twin {twin_setting.name}")

  def seed_config(setting: Setting, seed: int) -> ml_collections.ConfigDict:
    c = setting.config(cfg.run, int(seed))
    c.sft.base_dir = base_dir
    return c

  jobs = [lowrl_grid.Job.of({"setting": s.name, "seed": int(seed)},
                            run_config.fingerprint(seed_config(s, seed)), s)
          for s, seed in jobs_of]
  base = []  # the shared base, loaded once (the first run trains it)

  def work(job: lowrl_grid.Job) -> dict[str, Any]:
    setting, seed = job.payload, dict(job.key)["seed"]
    c = seed_config(setting, seed)
    run_dir = os.path.join(workdir, "runs", job.fingerprint)
    log(f"[ablate] {job.label} -> {run_dir}")
    t0 = time.time()
    summary = loop.run(c, run_dir, log=lambda s: None)
    if not base:
      base.append(loop.load_base(c, run_dir, log=lambda s: None))
    twin_c = seed_config(twin_setting, seed)
    twin_dir = os.path.join(workdir, "runs", run_config.fingerprint(twin_c))
    kl = _after_run(c, run_dir, twin_c, twin_dir, base[0], ref_kl=setting.group == "sr",
                    measure=tuple(cfg.after_run))
    line = {"group": setting.group, "run_dir": os.path.relpath(run_dir, workdir),
            "precision": dict(setting.precision)["name"], "sampler": setting.sampler,
            "overrides": dict(setting.overrides),
            "eval_start": summary["eval_start"], "eval_end": summary["eval_end"],
            **summarize_metrics(run_logs.read_metrics(run_dir)), **kl,
            "wall_s": time.time() - t0}
    log(f"[ablate] {setting.name} seed {seed}: pass@1 {line['eval_start']['pass_at_1']:.3f} -> "
        f"{line['eval_end']['pass_at_1']:.3f}, twin KL "
        f"{kl.get('twin_kl_end', float('nan')):.2e}, "
        f"{line['wall_s']:.0f}s")
    return line

  try:
    lowrl_grid.run(jobs, os.path.join(workdir, RESULTS), work, log=log, tag="ablate")
  except lowrl_grid.ResultsFileError as e:
    raise run_config.ConfigError(str(e)) from None
  results = read_results(workdir)
  log(f"[ablate] done: {len(results)} runs, {sum(r['wall_s'] for r in results):.0f}s of runs "
      f"in all; report: python -m experiments.report --workdir={workdir}")
  return results


def grid_main(flags, argv, fn: Callable[[ml_collections.ConfigDict, str, Log], Any]) -> None:
  """The body of a grid binary's main: the config of `flags` (configs/ablate.py by default),
  `fn(cfg, workdir, log)`; a config or workdir error, a run's failure or a preemption ends in one
  line and the status experiments/train.py gives it (lowrl.training.exits)."""
  from absl import logging  # noqa: PLC0415 - binaries only

  from lowrl.training import exits, schema  # noqa: PLC0415

  cfg = flags.start(argv, schema.TRAIN.docs("run."))
  if cfg is None:
    return
  logging.set_verbosity(logging.WARNING)
  with exits.one_line_exits():
    fn(cfg, flags.workdir.value, lambda s: print(s, flush=True))


def main(argv):
  grid_main(_FLAGS, argv, lambda cfg, workdir, log: run_grid(
      cfg, workdir, log=log, command="python -m experiments.ablate " + " ".join(sys.argv[1:])))


if __name__ == "__main__":
  from absl import app

  from lowrl.training import cli

  _FLAGS = cli.define_run_flags("ablate.py", "/tmp/lowrl_ablate", "Grid directory.")
  app.run(main, flags_parser=_FLAGS.parser())
