"""The report's document: docs/results.md (and its claims JSON and PNGs) from one or more grids."""
from __future__ import annotations

import dataclasses
import fnmatch
import json
import os
from typing import Sequence

from experiments.report import grids as grid_report, registry
from lowrl.analysis import stats
from lowrl.training import run_config

def claims_section(judged: Sequence[registry.Judged], many: bool) -> list[str]:
  """The claims, by question: the design checks first (apart), then per question its primary
  family (Holm within the question and grid) and its exploratory claims (raw p)."""
  label = lambda j: (f"[{j.grid}] " if many else "")  # noqa: E731
  def table(rows: Sequence[registry.Judged]) -> str:
    return stats.markdown_table([dataclasses.replace(j.verdict, claim=dataclasses.replace(
        j.verdict.claim, statement=label(j) + j.verdict.claim.statement)) for j in rows],
        digits=4)
  md = ["## Claims", "",
        "Registered by question before the runs (experiments/report/registry.py). Each claim is "
        "a paired difference (treatment - baseline on the same unit) with the sign it states; "
        "effect = its mean with the 95% interval (seeds: paired t; per-prompt KLs: batch-clustered "
        "bootstrap; an equivalence claim: TOST, its 90% interval against the registered margin). "
        "**Primary** claims: Holm-adjusted within their question's family (one per question and "
        "grid); **design checks**: the grid's own family, read before the claims they support; "
        "**exploratory** claims: raw p, no adjustment (their verdict says unadjusted). Verdict "
        "at 0.05: **held** (the stated sign), **contradicted** (the other sign), **not resolved**; "
        "**equivalent** / **not shown equivalent** for a TOST; **" + registry.NOT_READ + "**: a "
        "primary claim whose question's design checks on its grid were computed and none held "
        "(no Holm p: the premise it is asked under failed there).", ""]
  design = [j for j in judged if j.role == registry.DESIGN]
  if design:
    md += ["### Design checks", "", table(design), ""]
  for q in registry.QUESTIONS:
    mine = [j for j in judged if j.question is q and j.role != registry.DESIGN]
    if not mine:
      continue
    md += [f"### {q.title}", "", f"Source: {q.source}.", ""]
    margins = sorted({(j.grid, j.verdict.claim.name) for j in mine if j.verdict.claim.margin})
    if margins:
      md += ["| grid | claim | margin | why this size |", "|---|---|---|---|"]
      for grid, name in margins:
        m = registry.margin(grid, name)
        md.append(f"| {grid} | {name} | ±{stats.fmt_num(m.delta, 4)} | {m.reason} |")
      md.append("")
    for role, head in ((registry.PRIMARY, "Primary (Holm within the question)"),
                       (registry.EXPLORATORY, "Exploratory (raw p, not adjusted)")):
      rows = [j for j in mine if j.role == role]
      if rows:
        md += [f"{head}:", "", table(rows), ""]
  notes = [f"- {label(j)}{j.verdict.claim.statement}: {j.verdict.claim.note}" for j in judged
           if j.verdict.claim.note]
  if notes:
    md += ["Also (not adjusted):", "", *notes, ""]
  return md


def method_section() -> list[str]:
  """The registered design, from the registry: per question its primary claims, design checks
  and exploratory claims."""
  names = lambda ns: ", ".join(f"`{n}`" for n in ns) or "–"  # noqa: E731
  md = ["## Method", "",
        "Claims are registered by question before the runs (experiments/report/registry.py); a "
        "claim the report computes that the registry does not list is an error. Per grid, each "
        "question's primary claims are one Holm family and nothing else is in it; the design "
        "checks are the grid's own family, read before the claims they support (where a "
        "question's design checks were computed on a grid and none held, its primary claims "
        "are not read there); every other "
        "claim is exploratory (raw p and interval, no adjustment). Units: seeds (paired t, the "
        "sign test beside it), prompts of the forward-only ladder (a batch-clustered bootstrap "
        "of the mean: prompts of one batch share its key and activation scales; the sign test "
        "beside it), batches of the backward measurements (paired t). An equivalence is a TOST "
        "at 0.05 against a margin registered with its reason before the run. The twin KL (k3) "
        "is in no claim.", "",
        "| question | primary | design checks | exploratory |", "|---|---|---|---|"]
  for q in registry.QUESTIONS:
    md.append(f"| {q.title} | {names(q.primary)} | {names(q.design)} | "
              f"{names(q.exploratory)} |")
  return md + [""]


def _check(j: registry.Judged) -> str:
  """"`name` **verdict**, effect [95% CI], n N (Holm p P)" of a design check."""
  r = j.verdict.claim.result
  return (f"`{j.verdict.claim.name}` **{j.verdict.verdict}**, {stats.fmt_num(r.mean, 4)} "
          f"[{stats.fmt_num(r.ci_low, 4)}, {stats.fmt_num(r.ci_high, 4)}], n {r.n} (Holm p "
          f"{stats.fmt_p(j.verdict.p_holm)})")


def unread_questions(judged: Sequence[registry.Judged], grid: str
                     ) -> list[tuple[registry.Question, list[registry.Judged]]]:
  """The questions whose primary claims are not read on `grid` (registry.premise_holds), with
  the design checks that failed."""
  out = []
  for q in registry.QUESTIONS:
    design = [j for j in judged if j.grid == grid and j.question is q
              and j.role == registry.DESIGN]
    if not registry.premise_holds(q, [j.verdict for j in design]):
      out.append((q, design))
  return out


def coverage_section(grids: Sequence[grid_report.Grid],
                     judged: Sequence[registry.Judged]) -> list[str]:
  """What the registry expects that this report does not test: each registered grid it does not
  hold; per grid it holds, each question whose design checks failed (its primary claims are not
  read there) and the registered primary claims and design checks it could not compute, with
  why (measurements not run, settings not finished or not run)."""
  held = {g.label for g in grids}
  md = []
  for label, config in registry.GRIDS.items():
    if label not in held:
      md.append(f"- **{config}'s grid is not in this report**: no workdir of it was given "
                "(`--workdir` once per grid), so none of its registered claims is tested here. "
                "Numbers of earlier runs of it are not claims of this report (see "
                "[ablation.md](ablation.md) and this file's git history).")
  for g in grids:
    names = [j.verdict.claim.name for j in judged if j.grid == g.label]
    computed = lambda p: any(fnmatch.fnmatchcase(n, p) for n in names)  # noqa: E731
    why = []
    if not g.has_paired():
      why.append("experiments.paired has not run on this grid (the forward ladder, backward "
                 "and distance claims need it)")
    if g.unfinished():
      empty = g.not_run()
      why.append("some settings have not finished (above"
                 + (f"; {', '.join(empty)} ran no seed" if empty else "") + ")")
    why.append("this grid does not run the settings or measurements they need")
    listed = set()
    for q, failed in unread_questions(judged, g.label):
      done = [p for p in q.primary if computed(p)]
      rest = [p for p in q.primary if not computed(p)]
      line = (f"- **[{g.label}] design check failed**: {'; '.join(map(_check, failed))}. So "
              f"the primary claims of \"{q.title}\" are not read on this grid")
      if done:
        line += (f": {', '.join(f'`{p}`' for p in done)} (marked \"{registry.NOT_READ}\" in "
                 "the claims)")
      if rest:
        line += (f"{'; and' if done else ','} not computed either: "
                 f"{', '.join(f'`{p}`' for p in rest)}. Why not computed: " + "; or ".join(why))
      md.append(line + ".")
      listed.update(q.primary)
    absent = [f"`{p}` ({role}, {q.key})" for q, role, p in registry.registered()
              if p not in listed and not computed(p)]
    if absent:
      md.append(f"- **[{g.label}]** registered but not computed: {', '.join(absent)}. Why: "
                + "; or ".join(why) + ".")
  return (["## What this report does not test", "", *md, ""]) if md else []


def write_report(workdirs: str | Sequence[str], out_md: str, notes: Sequence[str] = (),
                 command: str | None = None) -> str:
  """Writes `out_md` and its PNGs from the results of one or more grid workdirs (their claims
  judged in the registry's families); returns the markdown. `notes`: paragraphs on how the
  grids ran that their files do not record (the machine's load, pauses), printed as given;
  `command`: the report's own command line, printed with them."""
  grids = [grid_report.Grid.load(w)
           for w in ([workdirs] if isinstance(workdirs, str) else workdirs)]
  labels = [g.label for g in grids]
  if len(set(labels)) != len(labels):
    raise run_config.ConfigError(f"two workdirs of the same grid config ({labels}); give each "
                                 "grid once.")
  os.makedirs(os.path.dirname(os.path.abspath(out_md)), exist_ok=True)
  many = len(grids) > 1
  judged = registry.judge([(g.label, g.claims()) for g in grids])
  md = ["# Recipe ablation in the real training loop", ""]
  if command:
    md += [f"Written by `{command}`.", ""]
  for g in grids:
    md += ([f"**[{g.label}]** configs/{g.label}.py."] if many else []) + g.header()
  if notes:
    md += ["How the grids ran (given to the report, not read from the results):", "",
           *[f"- {n}" for n in notes], ""]
  md += coverage_section(grids, judged)
  md += method_section()
  md += ["Numbers in the settings tables are mean ± population std over seeds (description; the "
         "claims are tested paired, below). Twin KL: KL(run || BF16 twin of the same seed) per "
         "completion token on the held-out prompts, k3 estimate on the run's samples (start: the "
         "base under both precisions); described only, no claim reads it (the exact static and "
         "trajectory distances carry the distance claims).", ""]
  md += claims_section(judged, many)
  md += grid_report.where_tested(labels)
  for g in grids:
    if many:
      md += [f"# The {g.label} grid (configs/{g.label}.py)", ""]
    md += g.body(out_md, "" if g.label == "ablate" or not many else f"_{g.label}")
  with open(os.path.splitext(out_md)[0] + "_claims.json", "w") as f:
    json.dump([j.row() for j in judged], f, indent=1)
  text = "\n".join(md) + "\n"
  with open(out_md, "w") as f:
    f.write(text)
  return text
