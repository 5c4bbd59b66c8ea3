"""The seed's forward components: does each of per-token activation scales, 4/6 block scaling and
the BF16 last 15% of layers lower the forward's error (and do they matter more with outlier
channels)?

Tested forward-only on identical tokens and weights (experiments/paired.py `forward_ladder`:
exact full-vocabulary KL(rung ‖ BF16) per prompt, the base with and without its planted outlier
channels; per-prompt KLs are heavy-tailed and prompts of one batch share its activation scales,
so these claims use a batch-clustered bootstrap of the mean and give the sign test beside it),
and along training in the seed-paired build-up of configs/ablate.py's recipe group (the
trajectory part of the distance to BF16; exploratory).
"""
from __future__ import annotations

from typing import Any

import numpy as np

from experiments.report import common, recipe_vs_bf16
from lowrl.analysis import stats

LADDER = common.LADDER


def build_up_pairs() -> list[tuple[str, str]]:
  """(previous, current) of each step of the build-up."""
  return list(zip(common.BUILD_UP, common.BUILD_UP[1:]))


def trajectory_claims(lines: list[dict[str, Any]]) -> list[stats.Claim]:
  """Each build-up step lowers the trajectory part of the distance to BF16 (mean over the
  checkpoints), paired by seed."""
  rows = recipe_vs_bf16.distance_rows(lines)
  _, what = recipe_vs_bf16.trajectory_what(rows)
  c = [common.seed_claim(rows, f"trajectory_{cur}", f"{cur} (after {prev}) also lowers the "
                         "trajectory part", cur, prev, common.get("trajectory_mean"), -1, what)
       for prev, cur in build_up_pairs()]
  return [x for x in c if x is not None]


def prompt_claim(name: str, statement: str, design: str, diffs: np.ndarray,
                 direction: int, prompts_per_batch: int | None) -> stats.Claim:
  """A claim on per-prompt differences (heavy-tailed KLs; prompts of one rollout batch share its
  sampling key and per-batch activation scales): the mean with a batch-clustered bootstrap
  (each prompt its own cluster when the line does not say its batches), the sign test in the
  note."""
  n = len(diffs)
  clusters = np.arange(n) // prompts_per_batch if prompts_per_batch else np.arange(n)
  unit = (f"batch-clustered bootstrap over {len(set(clusters.tolist()))} batches"
          if prompts_per_batch else "bootstrap over prompts (batches not recorded)")
  return stats.Claim(name, statement, f"{design}; mean, {unit}",
                     stats.cluster_bootstrap_mean_ci(diffs, clusters, rng_seed=0, n_boot=10_000),
                     direction, note=f"sign test p {stats.fmt_p(stats.sign_test(diffs))}")


def ladder_claims(ladder: dict[str, Any]) -> list[stats.Claim]:
  """Each rung of the forward ladder lowers the KL to BF16 (after the previous), paired by
  prompt."""
  lad, out = ladder.get("kl", {}), []
  for prev, cur in zip(LADDER, LADDER[1:]):
    if prev in lad and cur in lad:
      out.append(prompt_claim(
          f"ladder_{cur}", f"{cur} lowers the forward's KL to BF16 (after {prev})",
          "forward-only: same BF16-sampled tokens and weights, exact full-vocabulary KL(rung ‖ "
          f"BF16) per prompt; {cur} - {prev}, paired by prompt",
          np.asarray(lad[cur]) - np.asarray(lad[prev]), -1, ladder.get("prompts_per_batch")))
  return out


def outlier_claims(ladder: dict[str, Any]) -> list[stats.Claim]:
  """The planted outlier channels as a factor of the forward ladder (experiments/paired.py: the
  same tokens scored on the base with and without them), paired by prompt: they raise naive
  NVFP4's KL to BF16, and per-token scales + 4/6 remove more of it with them than without."""
  on, off = ladder.get("kl", {}), ladder.get("kl_unplanted", {})
  first, last = LADDER[0], "+4/6"
  if not (first in on and first in off and last in on and last in off):
    return []
  design = ("forward-only: same BF16-sampled tokens, the base with its planted outlier channels "
            "and without them (the same function in exact arithmetic), exact full-vocabulary "
            "KL(rung ‖ BF16) per prompt; {what}, paired by prompt")
  raise_d = np.asarray(on[first]) - np.asarray(off[first])
  removed_on = np.asarray(on[first]) - np.asarray(on[last])
  removed_off = np.asarray(off[first]) - np.asarray(off[last])
  ppb = ladder.get("prompts_per_batch")
  return [
      prompt_claim("outliers_raise_naive_kl", "Outlier channels raise naive NVFP4's KL to BF16",
                   design.format(what=f"{first}: planted - not planted"), raise_d, +1, ppb),
      prompt_claim("outliers_per_token_46_remove_more",
                   "Per-token scales and 4/6 remove more of the KL to BF16 with outlier channels "
                   "than without",
                   design.format(what=f"({first} - {last}) planted - ({first} - {last}) not "
                                      "planted"), removed_on - removed_off, +1, ppb)]


def ladder_section(ladder: dict[str, Any]) -> list[str]:
  """Per rung: KL(rung ‖ BF16) per token, mean [95% CI] over prompts (and without the outlier
  channels, with the paired difference, where measured)."""
  lad, off = ladder.get("kl", {}), ladder.get("kl_unplanted", {})
  if not lad:
    return []
  ci = lambda v: common.mean_ci(stats.paired_t(v))  # noqa: E731
  md = ["### Forward ladder (KL to BF16 on identical tokens and weights)", "",
        "| rung | prompts | KL(rung ‖ BF16) per token, mean [95% CI] |"
        + (" outliers not planted | planted - not planted |" if off else ""),
        "|---|---|---|" + ("---|---|" if off else "")]
  for name, v in lad.items():
    row = f"| {name} | {len(v)} | {ci(v)} |"
    if name in off:
      row += f" {ci(off[name])} | {ci(np.asarray(v) - np.asarray(off[name]))} |"
    md.append(row)
  return md + [""]
