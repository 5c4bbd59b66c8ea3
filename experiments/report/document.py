"""The report's document: docs/results.md (and its claims JSON and PNGs) from one or more grids."""
from __future__ import annotations

import dataclasses
import json
import os
from typing import Sequence

from experiments.report import grids as grid_report
from lowrl.analysis import stats
from lowrl.training import run_config

def write_report(workdirs: str | Sequence[str], out_md: str) -> str:
  """Writes `out_md` and its PNGs from the results of one or more grid workdirs (their claims
  judged as one Holm family); returns the markdown."""
  grids = [grid_report.Grid.load(w) for w in ([workdirs] if isinstance(workdirs, str) else workdirs)]
  labels = [g.label for g in grids]
  if len(set(labels)) != len(labels):
    raise run_config.ConfigError(f"two workdirs of the same grid config ({labels}); give each "
                                 "grid once.")
  os.makedirs(os.path.dirname(os.path.abspath(out_md)), exist_ok=True)
  many = len(grids) > 1
  claims = [dataclasses.replace(c, name=f"{g.label}/{c.name}", statement=f"[{g.label}] "
                                f"{c.statement}") if many else c
            for g in grids for c in g.claims()]
  verdicts = stats.judge(claims)
  md = ["# Recipe ablation in the real training loop", ""]
  for g in grids:
    md += ([f"**[{g.label}]** configs/{g.label}.py."] if many else []) + g.header()
  md += ["Numbers in the settings tables are mean ± population std over seeds (description; the "
         "claims are tested paired, below). Twin KL: KL(run || BF16 twin of the same seed) per "
         "completion token on the held-out prompts, k3 estimate on the run's samples (start: the "
         "base under both precisions).", "",
         "## Claims", "",
         "Each claim is a paired difference (treatment - baseline on the same unit) with the sign "
         "the claim states; effect = its mean with the 95% confidence interval of a paired t-test; "
         "Holm p = the t-test's p adjusted over all the claims below (one family"
         + (f", the {len(grids)} grids' together" if many else "") + "); verdict at 0.05: "
         "**held** (significant, the stated sign), **contradicted** (significant, the other "
         "sign), **not resolved** (not significant: the design cannot tell).", "",
         stats.markdown_table(verdicts, digits=4), ""]
  notes = [f"- {v.claim.statement}: {v.claim.note}" for v in verdicts if v.claim.note]
  if notes:
    md += ["Also (not Holm-adjusted):", "", *notes, ""]
  md += grid_report.where_tested(labels)
  for g in grids:
    if many:
      md += [f"# The {g.label} grid (configs/{g.label}.py)", ""]
    md += g.body(out_md, "" if g.label == "ablate" or not many else f"_{g.label}")
  with open(os.path.splitext(out_md)[0] + "_claims.json", "w") as f:
    json.dump([v.row() for v in verdicts], f, indent=1)
  text = "\n".join(md) + "\n"
  with open(out_md, "w") as f:
    f.write(text)
  return text
