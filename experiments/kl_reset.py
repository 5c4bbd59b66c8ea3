r"""KL reference reset in the simulator: do a fixed reference's collapsed prompts come back when the
reference is reset to the current policy? (seed 003 item 2; configs/kl_reset.py; docs/kl_reset.md)

  python -m experiments.kl_reset --workdir=/tmp/kl_reset                 # 5 arms x 10 seeds x 300
  python -m experiments.kl_reset --workdir=/tmp/kl_tiny --config=configs/kl_reset.py:tiny

Arms (configs/kl_reset.py), every seed in each, each run one jitted scan of the simulator
(lowrl.asyncrl): no_kl, fixed and reset at kl_coef, and the fixed reference at each of
`fixed_kl_coefs` (the restraint swept). Along each run the trainer's policy samples `pass_samples`
completions per held-out prompt (`scan.sampled_correct`); per seed and eval point the held-out
p_hat, the fraction of prompts with no correct sample and pass@k (lowrl.tasks.success).
A reset run restrains less than a fixed one at the same beta (it ends at a higher pass@1), so
reset vs fixed at one beta confounds the reset with a weaker restraint. The claims compare at
matched pass@1 instead: per seed the fixed reference's frontier (its arms at beta = 0 (no_kl),
each of fixed_kl_coefs and kl_coef: (pass@1, y) points) is interpolated linearly in pass@1 at the
reset run's pass@1 (`matched`; a seed whose reset pass@1 lies outside its frontier is left out
and counted). Claims, paired by seed and Holm-adjusted together (lowrl.analysis.stats):
  collapse  at reset's pass@1, a fixed reference leaves more prompts with no correct sample;
  pass@k    at reset's pass@1, resets give a higher pass@large_k;
  kl_bites  the fixed reference at kl_coef holds the run back: no_kl ends with a higher p_hat.
The unmatched comparisons at kl_coef (the earlier claims) are reported as exploratory.
Writes <workdir>/arms.json (the runs' raw numbers; a second run of the same config reuses them),
<workdir>/results.json (per arm, seed and eval point: the summaries and the raw counts),
<workdir>/report.md and <workdir>/kl_reset.png. A config error is one line on stderr, exit 2.
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
import time
from typing import Any, Callable

import ml_collections
import numpy as np
from absl import app

from lowrl.analysis import stats
from lowrl.tasks import success
from lowrl.asyncrl import simulator
from lowrl.training import cli, exits, run_config

Log = Callable[[str], None]
ARMS = ("no_kl", "fixed", "reset")  # + one fixed arm per fixed_kl_coefs value (arm_names)
RESULTS, REPORT, FIGURE = "results.json", "report.md", "kl_reset.png"
ARMS_FILE = "arms.json"  # the runs' raw numbers, written as soon as they finish


def arm_names(cfg: ml_collections.ConfigDict) -> tuple[str, ...]:
  """The arms of a config: ARMS, then "fixed_b<beta>" per fixed_kl_coefs value."""
  return ARMS + tuple(_fixed_arm(b) for b in cfg.get("fixed_kl_coefs", ()))


def _fixed_arm(beta: float) -> str:
  return f"fixed_b{beta:g}"


def frontier(cfg: ml_collections.ConfigDict) -> tuple[str, ...]:
  """The fixed-reference arms in order of beta: no_kl (0), fixed_kl_coefs, fixed (kl_coef)."""
  return ("no_kl",) + tuple(_fixed_arm(b) for b in sorted(cfg.get("fixed_kl_coefs", ()))) + (
      "fixed",)


def check(cfg: ml_collections.ConfigDict) -> None:
  """The experiment's own knobs (the simulator's are checked by simulator.build); ValueError
  naming the fix, before anything compiles."""
  seeds = tuple(cfg.seeds)
  if len(seeds) < 2 or len(set(seeds)) != len(seeds) or not all(isinstance(s, int) for s in seeds):
    raise ValueError(f"--config.seeds={cfg.seeds!r}: at least 2 distinct ints (the claims are "
                     "paired over seeds).")
  if not cfg.kl_coef > 0:
    raise ValueError(f"--config.kl_coef={cfg.kl_coef}: the KL arms need a coefficient > 0.")
  betas = tuple(cfg.get("fixed_kl_coefs", ()))
  if len(set(betas)) != len(betas) or not all(0 < b < cfg.kl_coef for b in betas):
    raise ValueError(f"--config.fixed_kl_coefs={betas!r}: distinct values in (0, kl_coef="
                     f"{cfg.kl_coef}) (the fixed reference's restraint between no_kl and fixed).")
  for name in ("ref_reset_every", "pass_eval_every", "pass_samples", "large_k"):
    v = cfg[name]
    if not isinstance(v, int) or isinstance(v, bool) or v < 1:
      raise ValueError(f"--config.{name}={v!r}: use an int >= 1.")
  if cfg.sim.rl.steps % cfg.pass_eval_every:
    raise ValueError(f"--config.pass_eval_every={cfg.pass_eval_every} must divide "
                     f"--config.sim.rl.steps={cfg.sim.rl.steps} (the last eval is the end).")
  if cfg.large_k > cfg.pass_samples:
    raise ValueError(f"--config.large_k={cfg.large_k} > --config.pass_samples="
                     f"{cfg.pass_samples}: pass@k needs k <= samples per prompt.")


def _setup(cfg: ml_collections.ConfigDict, kl_coef: float):
  sim = ml_collections.ConfigDict(cfg.sim.to_dict())
  sim.rl.kl_coef = kl_coef
  setup = dataclasses.replace(simulator.build(sim), pass_eval_every=cfg.pass_eval_every,
                              pass_eval_samples=cfg.pass_samples)
  return setup, simulator.schedule_of(sim)


def _counts(m: dict[str, np.ndarray]) -> np.ndarray:
  """[runs, points, P] correct counts at the start and after every eval's update."""
  curve = m["eval/pass/correct"]  # [runs, steps, P], -1 off the eval steps
  at = np.flatnonzero(curve[0, :, 0] >= 0)
  return np.concatenate([m["eval/start/pass_correct"][:, None], curve[:, at]], axis=1)


def run_arms(cfg: ml_collections.ConfigDict, log: Log = print) -> dict[str, Any]:
  """Runs the arms; {arm: {"counts": [S, points, P], "kl_ref": [S, steps], "per_seed":
  scalars [S]}, "names": the arms, "seeds", "points": update counts of the eval points, "timing":
  [{seeds, seconds, load}] (one entry per set of runs pooled)}."""
  check(cfg)
  seeds = tuple(int(s) for s in cfg.seeds)
  setup0, schedule = _setup(cfg, 0.0)
  setup_kl, _ = _setup(cfg, float(cfg.kl_coef))  # before any compile: every build checked
  extra = {_fixed_arm(b): _setup(cfg, float(b))[0] for b in cfg.get("fixed_kl_coefs", ())}
  load0 = os.getloadavg()
  t0 = time.perf_counter()
  # fixed and reset: one program (the reset plan is a runtime input). Every arm's seed s starts
  # from one bit-identical base: init and eval are one per-seed program for all three arms.
  s = len(seeds)
  res0 = simulator.simulate(setup0, schedule, seeds)
  log(f"[kl_reset] no_kl: compile {res0.compile_s:.0f} s, run {res0.run_s:.0f} s")
  res1 = simulator.simulate(setup_kl, schedule, seeds + seeds,
                            ref_reset_every=(0,) * s + (cfg.ref_reset_every,) * s)
  log(f"[kl_reset] fixed + reset: compile {res1.compile_s:.0f} s, run {res1.run_s:.0f} s")
  runs = {"no_kl": (res0.metrics, slice(0, s)), "fixed": (res1.metrics, slice(0, s)),
          "reset": (res1.metrics, slice(s, 2 * s))}
  compile_s, run_s = res0.compile_s + res1.compile_s, res0.run_s + res1.run_s
  for arm, setup in extra.items():  # one program per beta
    res = simulator.simulate(setup, schedule, seeds)
    log(f"[kl_reset] {arm}: compile {res.compile_s:.0f} s, run {res.run_s:.0f} s")
    runs[arm] = (res.metrics, slice(0, s))
    compile_s, run_s = compile_s + res.compile_s, run_s + res.run_s
  out: dict[str, Any] = {"names": list(arm_names(cfg))}
  for arm, (m, sl) in runs.items():
    # no_kl keeps no reference (kl_ref is logged only with one): NaN.
    kl_ref = m.get("kl_ref", np.full(m["reward/mean"].shape, np.nan))
    out[arm] = {"counts": _counts(m)[sl],
                "per_seed": {"greedy_start": m["eval/start/reward"][sl],
                             "greedy_end": m["eval/end/reward"][sl],
                             "greedy_exact_start": m["eval/start/exact"][sl],
                             "greedy_exact_end": m["eval/end/exact"][sl],
                             "kl_ref_mean": kl_ref[sl].mean(1),
                             "kl_ref_end": kl_ref[sl, -10:].mean(1),
                             "train_reward_end": m["reward/mean"][sl, -30:].mean(1)},
                "kl_ref": kl_ref[sl]}  # [S, steps]: KL to the reference during update t
  every, steps = cfg.pass_eval_every, cfg.sim.rl.steps
  out["points"] = list(range(0, steps + 1, every))
  out["seeds"] = list(seeds)
  out["timing"] = [{"seeds": list(seeds), "wall_s": time.perf_counter() - t0,
                    "compile_s": compile_s, "run_s": run_s,
                    "load_start": load0, "load_end": os.getloadavg()}]
  return out


def summaries(arms: dict[str, Any], n: int) -> dict[str, list[list[dict[str, float]]]]:
  """{arm: [seed][point] success_summary}."""
  return {arm: [[success.success_summary(c, n) for c in seed] for seed in arms[arm]["counts"]]
          for arm in arms["names"]}


def matched(summ: dict[str, Any], names: tuple[str, ...], key: str, arm: str = "reset",
            point: int = -1) -> np.ndarray:
  """Per seed: the fixed-reference frontier's `key` at `arm`'s pass@1 (p_hat) at `point`: the
  frontier arms' (p_hat, key) points sorted by p_hat, linear between the two that bracket it;
  NaN where `arm`'s p_hat lies outside the seed's frontier (no match without extrapolating)."""
  out = []
  for i in range(len(summ[arm])):
    x = np.array([summ[a][i][point]["p_hat"] for a in names])
    y = np.array([summ[a][i][point][key] for a in names])
    at = summ[arm][i][point]["p_hat"]
    order = np.argsort(x, kind="stable")
    out.append(float(np.interp(at, x[order], y[order])) if x.min() <= at <= x.max()
               else math.nan)
  return np.array(out)


def claims(summ: dict[str, Any], arms: dict[str, Any], cfg: ml_collections.ConfigDict
           ) -> tuple[list[stats.Verdict], list[str]]:
  """The report's claims (paired by seed, end of the run; reset against the fixed reference at
  matched pass@1), judged together; and the notes: per claim the sign test and the seeds left
  out; then the exploratory unmatched comparisons at kl_coef (paired t, sign test, and a
  bootstrap over (seed, prompt) units: the prompt-level spread, not the seed-level one)."""
  k = cfg.large_k
  end = lambda arm, key: np.array([s[-1][key] for s in summ[arm]])  # noqa: E731
  names = frontier(cfg)
  design = (f"end of {cfg.sim.rl.steps} updates, {cfg.pass_samples} samples per held-out prompt "
            f"({cfg.sim.eval_num_prompts} prompts); per-seed mean over prompts; ")
  match = (f"the fixed reference's frontier over beta in ({', '.join(names)}) interpolated at "
           "reset's pass@1, paired by seed")
  spec = [
      ("collapse", "At the pass@1 resets reach, a fixed reference leaves more held-out prompts "
       f"with no correct sample (of {cfg.pass_samples})", "zero_frac",
       matched(summ, names, "zero_frac") - end("reset", "zero_frac"), f"{match} - reset"),
      ("pass@k", f"At the pass@1 resets reach, resetting the reference gives a higher held-out "
       f"pass@{k}", f"pass@{k}", end("reset", f"pass@{k}") - matched(summ, names, f"pass@{k}"),
       f"reset - {match}"),
      ("kl_bites", f"The fixed reference (kl_coef {cfg.kl_coef}) holds the run back: no_kl ends "
       "with a higher held-out p_hat (pass@1)", "p_hat", end("no_kl", "p_hat")
       - end("fixed", "p_hat"), "no_kl - fixed, paired by seed"),
  ]
  out, notes = [], []
  for name, statement, key, d, how in spec:
    ok = np.isfinite(d)
    out.append(stats.Claim(name, statement, f"{key}: {design}{how}"
                           + (f" ({int(np.sum(~ok))} seeds outside the frontier left out)"
                              if not ok.all() else ""), stats.paired_t(d[ok]), direction=1))
    notes.append(f"{statement}: sign test p {stats.fmt_p(stats.sign_test(d[ok]))} "
                 f"({int(np.sum(d[ok] > 0))} of {int(ok.sum())} seeds in the stated direction, "
                 f"{int(np.sum(d[ok] == 0))} ties; {int(np.sum(~ok))} seeds outside the frontier)")
  return stats.judge(out), notes


def exploratory(summ: dict[str, Any], arms: dict[str, Any], cfg: ml_collections.ConfigDict
                ) -> list[list[str]]:
  """The unmatched comparisons at kl_coef (the earlier design's claims, confounded with the
  reset's weaker restraint), not Holm-adjusted: rows (comparison, n, difference [95% CI], p,
  sign p, bootstrap over (seed, prompt) units)."""
  k = cfg.large_k
  end = lambda arm, key: np.array([s[-1][key] for s in summ[arm]])  # noqa: E731
  per_prompt = {
      "zero_frac": {a: (arms[a]["counts"][:, -1] == 0).astype(float).ravel() for a in ARMS},
      f"pass@{k}": {a: np.concatenate([success.pass_at_k_per_prompt(c, cfg.pass_samples, k)
                                        for c in arms[a]["counts"][:, -1]]) for a in ARMS},
      "p_hat": {a: (arms[a]["counts"][:, -1] / cfg.pass_samples).ravel() for a in ARMS}}
  rows = []
  for key, a, b in (("zero_frac", "fixed", "reset"), (f"pass@{k}", "reset", "fixed"),
                    ("p_hat", "reset", "fixed"), ("p_hat", "no_kl", "reset")):
    d = end(a, key) - end(b, key)
    r = stats.paired_t(d)
    boot = stats.bootstrap_mean_ci(per_prompt[key][a], pairs=per_prompt[key][b],
                                   rng_seed=cfg.bootstrap_seed)
    rows.append([f"{key} at the end: {a} - {b} (kl_coef {cfg.kl_coef})", str(r.n),
                 f"{r.mean:+.4f} [{r.ci_low:+.4f}, {r.ci_high:+.4f}]", stats.fmt_p(r.p),
                 stats.fmt_p(stats.sign_test(d)),
                 f"{boot.mean:+.4f} [{boot.ci_low:+.4f}, {boot.ci_high:+.4f}]"])
  return rows


def _mean_ci(x: np.ndarray) -> str:
  x = np.asarray(x, float)
  if not np.all(np.isfinite(x)):
    return "–"
  r = stats.paired_t(x)
  return f"{r.mean:.3f} [{r.ci_low:.3f}, {r.ci_high:.3f}]"


def report(cfg: ml_collections.ConfigDict, arms: dict[str, Any], summ: dict[str, Any],
           verdicts: list[stats.Verdict], notes: list[str]) -> str:
  """The markdown report (docs/kl_reset.md holds a full run's)."""
  n, pts = cfg.pass_samples, arms["points"]
  ks = success.powers_of_two(n)
  load = lambda la: "/".join(f"{x:.1f}" for x in la)  # noqa: E731
  names = arms["names"]
  lines = [f"{len(arms['seeds'])} seeds x {len(names)} arms ({', '.join(names)}) x "
           f"{cfg.sim.rl.steps} updates; seeds "
           f"{', '.join(map(str, arms['seeds']))}.", ""]
  for tm in arms["timing"]:
    lines.append(f"- seeds {', '.join(map(str, tm['seeds']))}: wall {tm['wall_s'] / 60:.1f} min "
                 f"(compile {tm['compile_s']:.0f} s, run {tm['run_s']:.0f} s); load average "
                 f"(1/5/15 min) {load(tm['load_start'])} at the start, {load(tm['load_end'])} at "
                 "the end (2 CPU cores).")
  lines += [
      "", "## Claims", "",
      "Effect = mean over seeds of the paired difference at the end of the run, 95% CI of the "
      "paired t-test; Holm over the claims below; verdict at 0.05 (**not resolved**: the design "
      "cannot tell). Matched pass@1: per seed the fixed reference's arms (" +
      ", ".join(frontier(cfg)) + ") give (pass@1, y) points; y is interpolated linearly at the "
      "reset run's pass@1.", "", stats.markdown_table(verdicts, 4), "",
      "Also (not Holm-adjusted):", ""] + [f"- {x}" for x in notes] + [
      "", "## Exploratory: reset vs fixed at the same kl_coef (unmatched)", "",
      "The earlier design's comparisons: a reset run restrains less than a fixed one at the "
      "same beta, so these mix the reset with a weaker restraint (not Holm-adjusted).", "",
      "| comparison | n | difference [95% CI] | p | sign p | bootstrap over (seed, prompt) |",
      "|---|---|---|---|---|---|"] + [
      "| " + " | ".join(r) + " |" for r in exploratory(summ, arms, cfg)] + [
      "", "## Along the run", "",
      "Mean over seeds [95% t CI] of the per-seed mean over held-out prompts; updates = updates "
      "done before the eval.", "",
      "| arm | updates | p_hat (pass@1) | zero fraction | pass@" + str(cfg.large_k) + " | pass@"
      + str(n) + " |", "|---|---|---|---|---|---|"]
  for arm in names:
    for j, t in enumerate(pts):
      col = lambda key: _mean_ci([s[j][key] for s in summ[arm]])  # noqa: E731
      lines.append(f"| {arm} | {t} | {col('p_hat')} | {col('zero_frac')} | "
                   f"{col(f'pass@{cfg.large_k}')} | {col(f'pass@{n}')} |")
  lines += ["", f"## pass@k at the end ({cfg.sim.rl.steps} updates; start = the shared base)", "",
            "| arm | " + " | ".join(f"k={k}" for k in ks) + " |",
            "|---|" + "---|" * len(ks)]
  rows = [("start", [s[0] for s in summ["fixed"]])] + [(a, [s[-1] for s in summ[a]])
                                                        for a in names]
  for name, per_seed in rows:
    lines.append(f"| {name} | " + " | ".join(
        f"{np.mean([s[f'pass@{k}'] for s in per_seed]):.3f}" for k in ks) + " |")
  lines += ["", "## Other numbers per arm (mean over seeds [95% t CI])", "",
            "| arm | greedy reward start | greedy reward end | greedy exact end | train reward "
            "(last 30 updates) | KL to its reference, run mean | KL to its reference, last 10 |",
            "|---|---|---|---|---|---|---|"]
  for arm in names:
    p = arms[arm]["per_seed"]
    lines.append(f"| {arm} | {_mean_ci(p['greedy_start'])} | {_mean_ci(p['greedy_end'])} | "
                 f"{_mean_ci(p['greedy_exact_end'])} | {_mean_ci(p['train_reward_end'])} | "
                 f"{_mean_ci(p['kl_ref_mean'])} | {_mean_ci(p['kl_ref_end'])} |")
  lines += ["", f"![pass@k and collapsed prompts]({FIGURE})", ""]
  return "\n".join(lines)


def figure(cfg: ml_collections.ConfigDict, arms: dict[str, Any], summ: dict[str, Any],
           path: str) -> None:
  """pass@k against k at the end, and the zero fraction along the run, per arm."""
  import matplotlib  # noqa: PLC0415 (headless backend before pyplot)
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # noqa: PLC0415

  ks = success.powers_of_two(cfg.pass_samples)
  fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
  a.plot(ks, [np.mean([s[0][f"pass@{k}"] for s in summ["fixed"]]) for k in ks], "k:",
         label="start (base)")
  for arm in arms["names"]:
    a.plot(ks, [np.mean([s[-1][f"pass@{k}"] for s in summ[arm]]) for k in ks], "o-", label=arm)
    z = np.array([[p["zero_frac"] for p in s] for s in summ[arm]])
    b.errorbar(arms["points"], z.mean(0), yerr=z.std(0), capsize=3, label=arm)
  a.set(xscale="log", xlabel="k", ylabel="held-out pass@k", title="pass@k at the end")
  a.set_xticks(ks, [str(k) for k in ks])
  b.set(xlabel="updates", ylabel="fraction of prompts (mean ± std over seeds)",
        title=f"prompts with no correct sample of {cfg.pass_samples}")
  a.legend()
  b.legend()
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)


def _fingerprint(cfg: ml_collections.ConfigDict, *without: str) -> str:
  """The config's fingerprint without `pool_workdirs` (which runs join the analysis is not what
  ran) and the keys `without`."""
  d = {k: v for k, v in cfg.to_dict().items() if k not in ("pool_workdirs", *without)}
  return run_config.fingerprint(ml_collections.ConfigDict(d))


def _saved_arms(cfg: ml_collections.ConfigDict, workdir: str, *, fingerprint: str | None = None
                ) -> dict[str, Any] | None:
  """The arms a previous run of this config left in <workdir>/arms.json (None if none); another
  config's is an error, not a silent mix."""
  path = os.path.join(workdir, ARMS_FILE)
  if not os.path.exists(path):
    return None
  with open(path) as f:
    saved = json.load(f)
  if saved["fingerprint"] != (fingerprint or _fingerprint(cfg)):
    raise run_config.ConfigError(f"{path} holds another config's runs; use a fresh --workdir or "
                                 "delete it.")
  arms = saved["arms"]
  for arm in arms["names"]:
    arms[arm] = {"counts": np.array(arms[arm]["counts"]), "kl_ref": np.array(arms[arm]["kl_ref"]),
                 "per_seed": {k: np.array(v) for k, v in arms[arm]["per_seed"].items()}}
  return arms


def _save_arms(cfg: ml_collections.ConfigDict, workdir: str, arms: dict[str, Any]) -> None:
  plain = {k: v for k, v in arms.items() if k not in arms["names"]}
  plain.update({a: {"counts": arms[a]["counts"].tolist(), "kl_ref": arms[a]["kl_ref"].tolist(),
                    "per_seed": {k: np.asarray(v).tolist() for k, v in arms[a]["per_seed"].items()}}
                for a in arms["names"]})
  path = os.path.join(workdir, ARMS_FILE)
  with open(path + ".tmp", "w") as f:
    json.dump({"fingerprint": _fingerprint(cfg), "config": cfg.to_dict(), "arms": plain}, f,
              default=str)
  os.replace(path + ".tmp", path)


def _pooled_arms(cfg: ml_collections.ConfigDict, workdir: str) -> dict[str, Any]:
  """The arms of another workdir of this experiment: the same config but its seeds."""
  path = os.path.join(workdir, RESULTS)
  if not os.path.exists(path):
    raise run_config.ConfigError(f"--config.pool_workdirs: {path} does not exist; run the "
                                 "experiment there first (same config, other seeds).")
  with open(path) as f:
    other = ml_collections.ConfigDict(json.load(f)["config"])
  if _fingerprint(other, "seeds") != _fingerprint(cfg, "seeds"):
    raise run_config.ConfigError(f"--config.pool_workdirs: {workdir} ran another config (not "
                                 "only other seeds); pool only runs of this config.")
  return _saved_arms(other, workdir)


def _pool(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
  """Two sets of runs of one config with disjoint seeds, as one (seed order: a's, then b's)."""
  if set(a["seeds"]) & set(b["seeds"]):
    twice = sorted(set(a["seeds"]) & set(b["seeds"]))
    raise run_config.ConfigError(f"--config.pool_workdirs: seeds {twice} ran twice; pool runs of "
                                 "disjoint seeds.")
  out = {"seeds": a["seeds"] + b["seeds"], "points": a["points"], "names": a["names"],
         "timing": a["timing"] + b["timing"]}
  for arm in a["names"]:
    out[arm] = {"counts": np.concatenate([a[arm]["counts"], b[arm]["counts"]]),
                "kl_ref": np.concatenate([a[arm]["kl_ref"], b[arm]["kl_ref"]]),
                "per_seed": {k: np.concatenate([v, b[arm]["per_seed"][k]])
                             for k, v in a[arm]["per_seed"].items()}}
  return out


def run(cfg: ml_collections.ConfigDict, workdir: str, log: Log = print) -> list[stats.Verdict]:
  """Runs the experiment (or reuses the runs <workdir>/arms.json holds for this config) and
  writes results.json, report.md and kl_reset.png under `workdir`."""
  check(cfg)
  os.makedirs(workdir, exist_ok=True)
  arms = _saved_arms(cfg, workdir)
  if arms is None:
    arms = run_arms(cfg, log)
    _save_arms(cfg, workdir, arms)  # before the analysis: a report bug loses no run
  else:
    log(f"[kl_reset] reusing the runs in {os.path.join(workdir, ARMS_FILE)}")
  for other in cfg.pool_workdirs:
    arms = _pool(arms, _pooled_arms(cfg, other))
    log(f"[kl_reset] + the runs of {other} (seeds {arms['timing'][-1]['seeds']})")
  summ = summaries(arms, cfg.pass_samples)
  verdicts, notes = claims(summ, arms, cfg)
  with open(os.path.join(workdir, RESULTS), "w") as f:
    json.dump({"config": cfg.to_dict(), "seeds": arms["seeds"], "points": arms["points"],
               "timing": arms["timing"],
               "claims": [v.row() for v in verdicts],
               "arms": {a: {"summaries": summ[a], "counts": arms[a]["counts"].tolist(),
                            "kl_ref": arms[a]["kl_ref"].tolist(),
                            "per_seed": {k: np.asarray(v).tolist()
                                         for k, v in arms[a]["per_seed"].items()}}
                        for a in arms["names"]}}, f, default=str)
  with open(os.path.join(workdir, REPORT), "w") as f:
    f.write(report(cfg, arms, summ, verdicts, notes))
  figure(cfg, arms, summ, os.path.join(workdir, FIGURE))
  for v in verdicts:
    r = v.claim.result
    log(f"[kl_reset] {v.claim.name}: {r.mean:+.4f} [{r.ci_low:+.4f}, {r.ci_high:+.4f}] "
        f"Holm p {stats.fmt_p(v.p_holm)}: {v.verdict}")
  log(f"[kl_reset] -> {os.path.join(workdir, REPORT)}")
  return verdicts


def main(argv):
  cfg = _FLAGS.start(argv)
  if cfg is None:
    return
  try:
    check(cfg)
  except ValueError as e:
    cli.fail(str(e))
  with exits.one_line_exits():  # e.g. a results.jsonl of another config: one line
    run(cfg, _FLAGS.workdir.value, log=lambda s: print(s, flush=True))


if __name__ == "__main__":
  # Flags only when run as the binary: a test importing this module beside another binary's
  # (both define --workdir) must not collide in absl's global registry.
  _FLAGS = cli.define_run_flags("kl_reset.py", "/tmp/lowrl_kl_reset",
                                "Output directory (results.json, report.md, kl_reset.png).")
  app.run(main, flags_parser=_FLAGS.parser())
