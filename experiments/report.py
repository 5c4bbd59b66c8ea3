r"""The ablation's report: docs/results.md with PNG plots, from an experiments/ablate.py workdir.

  python -m experiments.report --workdir=/tmp/lowrl_ablate        # writes docs/results.md
  python -m experiments.report --workdir=W --out=/tmp/results.md   # elsewhere

For each claim (the recipe tracks BF16 while naive NVFP4 does not; each recipe component's
contribution; dequantized vs quantized backward; BF16 + stochastic rounding vs FP16 master-weight
erasure; KL reference reset; RL gains over the base at BF16) the measured numbers as mean +- std
over seeds, whether the claim held under the stated test, and the command that reproduces them.
The PNGs are written next to the markdown file (`<stem>_*.png`).
"""
from __future__ import annotations

import json
import os
from typing import Any

import numpy as np

from experiments import ablate
from lowrl.training import run_logs

_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BUILD_UP = ("nvfp4_naive", "+per_token", "+4/6", "+bf16_tail", "nvfp4_recipe")


def _stats(values: list[float | None]) -> tuple[float, float, int] | None:
  """(mean, population std, n) of the non-None values; None when there are none."""
  v = [x for x in values if x is not None]
  return (float(np.mean(v)), float(np.std(v)), len(v)) if v else None


def _fmt(s: tuple[float, float, int] | None, digits: int = 3) -> str:
  if s is None:
    return "–"
  m, sd, n = s
  fmt = (lambda x: f"{x:.{digits}f}") if max(abs(m), sd) >= 10**-digits or m == 0 else (
      lambda x: f"{x:.1e}")
  return f"{fmt(m)} ± {fmt(sd)}" if n > 1 else fmt(m)


def aggregate(results: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
  """{setting: {group, n, and for every per-run number its (mean, std, n) over seeds}}, in
  results order."""
  out: dict[str, dict[str, Any]] = {}
  for r in results:
    out.setdefault(r["setting"], {"group": r["group"], "runs": []})["runs"].append(r)
  for s in out.values():
    runs = s["runs"]
    s["n"] = len(runs)
    for when in ("start", "end"):
      for k in ("pass_at_1", "greedy"):
        s[f"{k}_{when}"] = _stats([r[f"eval_{when}"][k] for r in runs])
    s["gain"] = _stats([r["eval_end"]["pass_at_1"] - r["eval_start"]["pass_at_1"] for r in runs])
    for k in ("final_reward", "mismatch_kl", "mismatch_kl_k3", "ess", "kl_ref", "grad_cos",
              "grad_rel_err", "update_erasure", "twin_kl_start", "twin_kl_end",
              "twin_kl_k3_start", "twin_kl_k3_end"):
      s[k] = _stats([r.get(k) for r in runs])
  return out


def _curves(workdir: str, agg: dict, setting: str, key: str) -> tuple[np.ndarray, np.ndarray,
                                                                       np.ndarray] | None:
  """(steps, mean, std) over seeds of metrics.jsonl's `key` for `setting`."""
  series = []
  for r in agg[setting]["runs"]:
    rows = [x for x in run_logs.read_metrics(os.path.join(workdir, r["run_dir"]))
            if x.get(key) is not None]
    series.append({x["step"]: x[key] for x in rows})
  steps = sorted(set.intersection(*(set(s) for s in series))) if series else []
  if not steps:
    return None
  y = np.array([[s[t] for t in steps] for s in series])
  return np.array(steps), y.mean(0), y.std(0)


def _apart(a, b, k: float = 1.0) -> bool:
  """a's mean is below b's by more than k times the sum of their seed stds."""
  return a is not None and b is not None and b[0] - a[0] > k * (a[1] + b[1])


def claims(agg: dict[str, dict[str, Any]]) -> list[tuple[str, str | None, list[str]]]:
  """[(claim, "held" / "did not hold" / None when not measured, lines of evidence)]."""
  out = []
  g = lambda s, k: agg.get(s, {}).get(k)  # noqa: E731

  bf = agg.get("bf16")
  if bf and bf["n"] > 1:
    gain, end = bf["gain"], bf["pass_at_1_end"]
    held = gain[0] > 3 * end[1]
    out.append(("RL gains over the base at BF16 by more than 3 seed std of held-out pass@1",
                "held" if held else "did not hold",
                [f"bf16 pass@1 {_fmt(bf['pass_at_1_start'])} -> {_fmt(end)}, gain {_fmt(gain)}; "
                 f"test: gain > 3 x std(end) = {3 * end[1]:.3f}"]))
  if all(s in agg for s in ("bf16", "nvfp4_naive", "nvfp4_recipe")):
    held = _apart(g("nvfp4_recipe", "twin_kl_k3_end"), g("nvfp4_naive", "twin_kl_k3_end"))
    out.append(("The 4-bitter recipe tracks the BF16 twin while naive NVFP4 does not "
                "(KL to the BF16 twin's final policy, lower is closer)",
                "held" if held else "did not hold",
                [f"{s}: twin KL end {_fmt(g(s, 'twin_kl_k3_end'))} (start {_fmt(g(s, 'twin_kl_k3_start'))}),"
                 f" pass@1 gain {_fmt(g(s, 'gain'))}, final reward {_fmt(g(s, 'final_reward'))}"
                 for s in ("bf16", "nvfp4_naive", "nvfp4_recipe") if s in agg]
                + ["test: recipe's twin KL below naive's by more than the sum of their seed stds"]))
  steps = [s for s in BUILD_UP if s in agg]
  if len(steps) == len(BUILD_UP):  # each component needs the whole build-up
    lines = []
    for prev, cur in zip(steps, steps[1:]):
      a, b = g(cur, "twin_kl_k3_end"), g(prev, "twin_kl_k3_end")
      lines.append(f"{cur} (after {prev}): twin KL end {_fmt(a)} vs {_fmt(b)} "
                   f"({'lower beyond the seed spread' if _apart(a, b) else 'not separated'}); "
                   f"grad cos {_fmt(g(cur, 'grad_cos'), 4)}; pass@1 gain {_fmt(g(cur, 'gain'))}")
    helped = sum(_apart(g(c, "twin_kl_k3_end"), g(p, "twin_kl_k3_end")) for p, c in zip(steps, steps[1:]))
    out.append(("Each component of the recipe brings the policy closer to BF16",
                "held" if helped == len(steps) - 1 else "did not hold",
                lines + [f"{helped} of {len(steps) - 1} components lowered the twin KL beyond the "
                         "seed spread"]))
  if "nvfp4_recipe" in agg and "nvfp4_recipe_qbwd" in agg:
    a, b = g("nvfp4_recipe_qbwd", "grad_cos"), g("nvfp4_recipe", "grad_cos")
    out.append(("The dequantized backward gives a gradient closer to FP32 than the quantized one",
                "held" if _apart(a, b) else "did not hold",
                [f"{s}: grad cos vs FP32 {_fmt(g(s, 'grad_cos'), 4)}, rel err "
                 f"{_fmt(g(s, 'grad_rel_err'))}, pass@1 gain {_fmt(g(s, 'gain'))}"
                 for s in ("nvfp4_recipe", "nvfp4_recipe_qbwd")]
                + ["test: quantized backward's cosine below the dequantized one's by more than "
                   "the sum of their seed stds"]))
  sr = sorted({s.split("@")[1] for s in agg if s.startswith("bf16_sr@")},
              key=lambda t: -float(t))
  if sr:
    lines, held_all = [], True
    for lr in sr:
      rtn, srr = g(f"bf16_rtn@{lr}", "update_erasure"), g(f"bf16_sr@{lr}", "update_erasure")
      held_all &= _apart(srr, rtn)
      lines.append(f"lr {lr}: erasure RTN {_fmt(rtn)}, SR {_fmt(srr)}; final reward " + ", ".join(
          f"{m} {_fmt(g(f'{m}@{lr}', 'final_reward'))}"
          for m in ("fp32_master", "bf16_rtn", "bf16_sr", "fp16") if f"{m}@{lr}" in agg))
    out.append(("BF16 master weights with round-to-nearest erase updates that stochastic rounding "
                "keeps", "held" if held_all else "did not hold",
                lines + ["test: SR's erasure below RTN's by more than the seed spread at every lr"]))
  if "kl" in agg and "kl+reset" in agg:
    a, b = g("kl+reset", "kl_ref"), g("kl", "kl_ref")
    out.append(("Resetting the KL reference keeps the KL penalty small along the run",
                "held" if _apart(a, b) else "did not hold",
                [f"{s}: mean KL to the reference {_fmt(g(s, 'kl_ref'))}, final reward "
                 f"{_fmt(g(s, 'final_reward'))}, pass@1 gain {_fmt(g(s, 'gain'))}"
                 for s in ("kl", "kl+reset")]))
  return out


def _plots(workdir: str, agg: dict, out_md: str) -> list[str]:
  """The PNGs next to `out_md`; returns their file names."""
  import matplotlib  # noqa: PLC0415 (headless backend before pyplot)
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # noqa: PLC0415
  stem = os.path.splitext(out_md)[0]
  names = list(agg)
  files = []

  def save(fig, tag):
    path = f"{stem}_{tag}.png"
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    files.append(os.path.basename(path))

  fig, axes = plt.subplots(1, 3, figsize=(18, 5))
  for ax, key, title in zip(axes, ("pass_at_1_end", "twin_kl_k3_end", "grad_cos"),
                            ("held-out pass@1 (end; dashed: base)", "KL to the BF16 twin (end, k3)",
                             "gradient cosine vs FP32")):
    vals = [agg[n][key] for n in names]
    y = [v[0] if v else np.nan for v in vals]
    e = [v[1] if v else 0 for v in vals]
    ax.bar(range(len(names)), y, yerr=e, capsize=3)
    if key == "pass_at_1_end" and agg[names[0]]["pass_at_1_start"]:
      ax.axhline(agg[names[0]]["pass_at_1_start"][0], ls="--", c="k")
    ax.set_xticks(range(len(names)), names, rotation=70, fontsize=7)
    ax.set_title(title)
  save(fig, "settings")

  groups = {}
  for n in names:
    groups.setdefault(agg[n]["group"], []).append(n)
  keys = (("reward/mean", "training reward"), ("mismatch/mismatch_kl", "mismatch KL (k1)"),
          ("kl_ref", "KL to the reference"))
  fig, axes = plt.subplots(len(groups), 3, figsize=(18, 4 * len(groups)), squeeze=False)
  for row, (group, members) in enumerate(groups.items()):
    for col, (key, title) in enumerate(keys):
      ax = axes[row, col]
      for n in members + ([ablate_twin(agg)] if group != "recipe" and ablate_twin(agg) else []):
        c = _curves(workdir, agg, n, key)
        if c is not None:
          ax.plot(c[0], c[1], label=n)
          ax.fill_between(c[0], c[1] - c[2], c[1] + c[2], alpha=0.15)
      ax.set_title(f"{group}: {title}")
      ax.set_xlabel("step")
      if col == 0:
        ax.legend(fontsize=7)
  save(fig, "curves")
  return files


def ablate_twin(agg: dict) -> str | None:
  return next(iter(agg), None)  # ablate.settings puts the twin first


def _table(agg: dict) -> str:
  cols = (("n", None), ("pass@1 start", "pass_at_1_start"), ("pass@1 end", "pass_at_1_end"),
          ("gain", "gain"), ("greedy end", "greedy_end"), ("final reward", "final_reward"),
          ("mismatch k1", "mismatch_kl"), ("ESS", "ess"), ("grad cos", "grad_cos"),
          ("grad rel err", "grad_rel_err"), ("erasure", "update_erasure"),
          ("twin KL start", "twin_kl_k3_start"), ("twin KL end", "twin_kl_k3_end"),
          ("KL to ref", "kl_ref"))
  lines = ["| setting | group | " + " | ".join(c for c, _ in cols) + " |",
           "|" + "---|" * (len(cols) + 2)]
  for n, s in agg.items():
    cells = [str(s["n"]) if k is None else _fmt(s[k], 4 if k == "grad_cos" else 3)
             for _, k in cols]
    lines.append(f"| {n} | {s['group']} | " + " | ".join(cells) + " |")
  return "\n".join(lines)


def write_report(workdir: str, out_md: str) -> str:
  """Writes `out_md` and its PNGs from `workdir`'s results; returns the markdown."""
  results = ablate.read_results(workdir)
  if not results:
    raise ValueError(f"{workdir}/{ablate.RESULTS} has no results; run experiments.ablate first.")
  agg = aggregate(results)
  meta_path = os.path.join(workdir, ablate.GRID)
  meta = json.load(open(meta_path)) if os.path.exists(meta_path) else {}
  os.makedirs(os.path.dirname(os.path.abspath(out_md)), exist_ok=True)
  pngs = _plots(workdir, agg, out_md)
  wall = sum(r["wall_s"] for r in results)
  md = ["# Recipe ablation in the real training loop", "",
        f"Reproduce: `{meta.get('command', 'python -m experiments.ablate --workdir=W')}` then "
        f"`python -m experiments.report --workdir={workdir}`.", "",
        f"{len(results)} runs ({len(agg)} settings x seeds {meta.get('seeds', '?')}); wall time "
        f"of the runs {wall / 60:.1f} min in all ({meta.get('machine', 'this machine')}). Numbers "
        "are mean ± population std over seeds. Twin KL: KL(run || BF16 twin of the same seed) "
        "per completion token on the held-out prompts, k3 estimate on the run's samples (start: "
        "the base under both precisions).",
        ""]
  if meta.get("quick"):
    md += ["**This is the quick grid** (`--config.quick=True`: 8 RL steps of 8 prompts x 4, "
           "16 held-out prompts): it checks that every part of the experiment runs; its numbers "
           "are too small and short to test the claims.", ""]
  missing = [s for s in meta.get("settings", []) if s not in agg]
  if missing:
    md += [f"Not finished (no results yet): {', '.join(missing)}.", ""]
  md += ["## Claims", ""]
  for claim, verdict, lines in claims(agg):
    md.append(f"- **{claim}**: {verdict or 'not measured'}.")
    md.extend(f"  - {x}" for x in lines)
  md += ["", "## All settings", "", _table(agg), ""]
  md += [f"![{p}]({p})" for p in pngs]
  text = "\n".join(md) + "\n"
  with open(out_md, "w") as f:
    f.write(text)
  return text


def main(argv):
  del argv
  write_report(_WORKDIR.value, _OUT.value)
  print(f"[report] wrote {_OUT.value}")


if __name__ == "__main__":
  from absl import app, flags

  _WORKDIR = flags.DEFINE_string("workdir", None, "An experiments.ablate workdir.", required=True)
  _OUT = flags.DEFINE_string("out", os.path.join(_REPO, "docs", "results.md"),
                             "Markdown file to write (PNGs next to it).")
  app.run(main)
