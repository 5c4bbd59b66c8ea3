r"""The regime probe: shows a grid config's outlier channels and times a few updates of its settings.

  python -m experiments.regime --workdir=/tmp/lowrl_regime --config=configs/ablate_regime.py

Writes `<workdir>/regime.json`, which experiments/report prints (docs/ablation.md, "A regime
where the effects can appear"):
  outliers  lowrl.training.outliers.channel_stats of the timing base (below; with
            --config.timing.sft_steps=<run.sft.steps> the grid's own base, <workdir>/base, the
            one experiments.ablate trains in the same workdir) with the config's planted
            channels and without them (the same stored base), on the normed inputs of every layer's
            matmuls over `eval_num_prompts` held-out prompts with their answers: the largest
            per-channel max |activation| over the median channel's, kurtosis, the top channel;
  timing    per setting of `timing.settings`: the wall time of RL steps 3..`timing.rl_steps`
            of the loop (step 1 compiles; step 2 left out too, in case a program first runs there), from a base of `timing.sft_steps` SFT steps (a few:
            the cost of an update does not depend on how well the base sorts, and an untrained
            base fills the whole completion budget, the dearest case), and the SFT step's;
  estimate  the grid's CPU time from those: one base, then settings x seeds x rl.steps steps.
The runs go to `<workdir>/timing/<setting>` (deleted first: a timing is never resumed).
"""
from __future__ import annotations

import json
import os
import shutil
import time
from typing import Any, Callable

import jax.numpy as jnp
import ml_collections
import numpy as np

from experiments import ablate, paired
from lowrl.tasks.batching import encode_sft
from lowrl.training import loop, optimizer, outliers, run_config, run_logs
from lowrl.training.setup import build
from lowrl.training.trainer import Trainer

Log = Callable[[str], None]
RESULTS = "regime.json"


class _Stamps:
  """A loop log that time-stamps its "[rl] step k/n" and "[sft] step k/n" lines."""

  def __init__(self):
    self.rl: list[float] = []
    self.sft: list[tuple[int, float]] = []

  def __call__(self, line: str) -> None:
    if line.startswith("[rl] step "):
      self.rl.append(time.perf_counter())
    elif line.startswith("[sft] step "):
      self.sft.append((int(line.split()[2].split("/")[0]), time.perf_counter()))


def _summary(stats: dict[str, dict[str, float]]) -> dict[str, Any]:
  ratios = [s["max_over_median"] for s in stats.values()]
  return {"per_norm": stats, "max_over_median_median": float(np.median(ratios)),
          "kurtosis_median": float(np.median([s["kurtosis"] for s in stats.values()]))}


def outlier_probe(cfg: ml_collections.ConfigDict, bases: str, work: str, log: Log
                  ) -> dict[str, Any]:
  """channel_stats of the base with and without the planted channels (module docstring)."""
  c = ml_collections.ConfigDict(cfg.run.to_dict())
  c.sft.update(base_dir=bases, steps=int(cfg.timing.sft_steps))
  off = ml_collections.ConfigDict(c.to_dict())
  off.sft.outlier_channels = 0  # the stored base itself (the channels are planted on loading)
  setup = build(c)
  task = setup.task
  exs = task.sample(np.random.default_rng(int(c.seed)), int(c.eval_num_prompts), split="eval")
  tokens, mask = encode_sft(task.tokenizer, [e.prompt for e in exs],
                            [task.target_text(e) for e in exs],
                            task.max_prompt_len + task.max_answer_len + 1)
  real = jnp.asarray(tokens != task.tokenizer.pad_id)
  stats = {name: _summary(outliers.channel_stats(loop.load_base(k, work, log=lambda _: None),
                                                 jnp.asarray(tokens), real, setup.model_cfg))
           for name, k in (("planted", c), ("unplanted", off))}
  out = {"channels": list(outliers.channels(setup.model_cfg.d_model,
                                            int(c.sft.outlier_channels))),
         "gain": float(c.sft.outlier_gain), "tokens": int(np.asarray(real).sum()), **stats}
  log(f"[regime] outliers: max/median channel {out['unplanted']['max_over_median_median']:.1f} "
      f"-> {out['planted']['max_over_median_median']:.1f} (median over norms), kurtosis "
      f"{out['unplanted']['kurtosis_median']:.1f} -> {out['planted']['kurtosis_median']:.1f}")
  return out


def base_dir(cfg: ml_collections.ConfigDict, workdir: str) -> str:
  """Where the probe's base is stored: the grid's own (`<workdir>/base`, experiments.ablate's)
  when timing.sft_steps is the grid's run.sft.steps (the same base: reused, or trained once for
  both), else `<workdir>/timing_base`."""
  same = int(cfg.timing.sft_steps) == int(cfg.run.sft.steps)
  return os.path.join(workdir, "base" if same else "timing_base")


def time_settings(cfg: ml_collections.ConfigDict, workdir: str, log: Log) -> dict[str, Any]:
  """Wall seconds per RL step (steps 3.. of `timing.rl_steps`) and per SFT step, per setting."""
  t = cfg.timing
  every = paired.all_settings(cfg)
  out = {}
  for name in t.settings:
    c = every[name].config(cfg.run, int(cfg.seeds[0]))
    c.sft.update(steps=int(t.sft_steps), base_dir=base_dir(cfg, workdir))
    c.rl.steps = int(t.rl_steps)
    c.log_every = 1
    c.eval_num_prompts, c.eval_samples = 8, 1
    c.checkpoint_every = int(t.rl_steps)
    c.checkpoint_keep_fractions = ()
    run_dir = os.path.join(workdir, "timing", name)
    shutil.rmtree(run_dir, ignore_errors=True)
    stamps = _Stamps()
    t0 = time.perf_counter()
    loop.run(c, run_dir, log=stamps)
    rl = np.diff(stamps.rl)[1:] if len(stamps.rl) > 2 else np.array([np.nan])
    sft = ([(b[1] - a[1]) / (b[0] - a[0]) for a, b in zip(stamps.sft, stamps.sft[1:])]
           if len(stamps.sft) > 1 else [])
    out[name] = {"rl_step_s": float(np.mean(rl)), "rl_step_s_spread": float(np.std(rl)),
                 "timed_steps": int(rl.size), "sft_step_s": float(np.mean(sft)) if sft else None,
                 "wall_s": time.perf_counter() - t0,
                 "response_length": _mean_length(run_dir)}
    log(f"[regime] {name}: {out[name]['rl_step_s']:.1f} s per RL step "
        f"(± {out[name]['rl_step_s_spread']:.1f}, {rl.size} steps), completions "
        f"{out[name]['response_length']:.0f} tokens")
  return out


def _mean_length(run_dir: str) -> float:
  rows = run_logs.read_metrics(run_dir)
  return float(np.mean([r["response_length"] for r in rows])) if rows else float("nan")


def time_forward_ladder(cfg: ml_collections.ConfigDict, workdir: str, log: Log) -> dict[str, Any]:
  """Seconds per rollout batch of experiments/paired.py's forward-only ladder at the config's
  sizes: sampling one batch from the (timing) base in BF16, and scoring it by every rung (each
  measured on a second batch, after a first that compiles)."""
  every = paired.all_settings(cfg)
  bases = base_dir(cfg, workdir)
  c = ml_collections.ConfigDict(cfg.to_dict())
  c.run.sft.steps = int(cfg.timing.sft_steps)
  twin_cfg = paired._setting_config(c, every[cfg.twin], bases)  # noqa: SLF001
  setups = {n: build(paired._setting_config(c, every[n], bases))  # noqa: SLF001
            for n in paired.LADDER}
  twin = Trainer(build(twin_cfg), log=lambda _: None)
  base = loop.load_base(twin_cfg, os.path.join(workdir, "timing", "probe"), log=lambda _: None)
  params = twin.place(optimizer.to_master(base, twin_cfg.optimizer.master_dtype))
  paired.sample_batches(twin, params, 1)
  t0 = time.perf_counter()
  rollouts = paired.sample_batches(twin, params, 1, first_step=1)
  sample_s = time.perf_counter() - t0
  quiet = lambda _: None  # noqa: E731
  paired.forward_ladder(c, setups, twin.setup, params, rollouts, quiet)
  t0 = time.perf_counter()
  paired.forward_ladder(c, setups, twin.setup, params, rollouts, quiet)
  ladder_s = time.perf_counter() - t0
  log(f"[regime] forward ladder: {sample_s:.1f} s to sample a batch, {ladder_s:.1f} s to score "
      f"it by the {len(paired.LADDER)} rungs")
  return {"sample_batch_s": sample_s, "ladder_batch_s": ladder_s,
          "rows_per_batch": int(cfg.run.rl.num_prompts * cfg.run.rl.group_size)}


def estimate(cfg: ml_collections.ConfigDict, timing: dict[str, Any]) -> dict[str, Any]:
  """The grid's CPU hours from the timed steps: settings x seeds x rl.steps steps at the mean
  quantized setting's step time (the BF16 twin's for itself), plus the base's SFT."""
  names = [s.name for s in ablate.settings(cfg)]
  quant = [v["rl_step_s"] for k, v in timing.items() if k != cfg.twin]
  step_q = float(np.mean(quant)) if quant else float("nan")
  step_t = timing.get(cfg.twin, {}).get("rl_step_s", step_q)
  sft = [v["sft_step_s"] for v in timing.values() if v.get("sft_step_s")]
  steps, seeds = int(cfg.run.rl.steps), len(cfg.seeds)
  rl_s = seeds * steps * (step_t + (len(names) - 1) * step_q)
  sft_s = int(cfg.run.sft.steps) * (float(np.mean(sft)) if sft else 0.0)
  return {"settings": names, "seeds": seeds, "rl_steps": steps, "step_s_quantized": step_q,
          "step_s_twin": step_t, "rl_hours": rl_s / 3600, "sft_hours": sft_s / 3600,
          "hours": (rl_s + sft_s) / 3600, "per_run_hours": steps * step_q / 3600}


def run(cfg: ml_collections.ConfigDict, workdir: str, log: Log = print) -> dict[str, Any]:
  """The probe of the grid config `cfg` in `workdir`; writes and returns regime.json."""
  if "timing" not in cfg:
    raise run_config.ConfigError("the config has no `timing` section: use "
                                 "--config=configs/ablate_regime.py (or add one like it).")
  ablate.validate(cfg)  # every setting builds, before anything runs
  os.makedirs(workdir, exist_ok=True)
  timing = time_settings(cfg, workdir, log)
  out = {"outliers": outlier_probe(cfg, base_dir(cfg, workdir),
                                   os.path.join(workdir, "timing", "probe"), log),
         "timing": timing, "ladder": time_forward_ladder(cfg, workdir, log),
         "estimate": estimate(cfg, timing),
         "machine": f"{os.cpu_count()} CPU cores", "load": os.getloadavg()[0]}
  e = out["estimate"]
  log(f"[regime] the grid: {len(e['settings'])} settings x {e['seeds']} seeds x "
      f"{e['rl_steps']} steps = {e['hours']:.1f} h on this machine ({e['per_run_hours']:.2f} h "
      "per quantized run)")
  with open(os.path.join(workdir, RESULTS), "w") as f:
    json.dump(out, f, indent=1)
  return out


def read_results(workdir: str) -> dict[str, Any] | None:
  path = os.path.join(workdir, RESULTS)
  if not os.path.exists(path):
    return None
  with open(path) as f:
    return json.load(f)


def main(argv):
  ablate.grid_main(_FLAGS, argv, lambda cfg, workdir, log: run(cfg, workdir, log=log))


if __name__ == "__main__":
  from absl import app

  from lowrl.training import cli

  _FLAGS = cli.define_run_flags("ablate_regime.py", "/tmp/lowrl_regime", "Probe directory.")
  app.run(main, flags_parser=_FLAGS.parser())
