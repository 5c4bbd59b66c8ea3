"""The ablation's claims, registered by question before the runs they read.

Each question of the seeds (/work/shared/seeds; docs/reference.md §5) has 1-3 PRIMARY claims,
Holm-adjusted as a family of their own (one family per question and grid: each grid is its own
study), the DESIGN CHECKS that must hold before its claims are read (the baseline learns, the
planted outliers exist; Holm-adjusted as the grid's design family, reported first and apart) and
EXPLORATORY claims (everything else: raw p and CI, not adjusted, labelled so in the tables). A
claim a report computes that this registry does not list is an error, so a claim cannot join a
family after a look.

Equivalence margins (`MARGINS`) are fixed here, with the reason for their size, before the grids
they judge are rerun; a margin is never read off the run it judges.
"""
from __future__ import annotations

import dataclasses
import fnmatch
import math
from typing import Iterable, Sequence

from lowrl.analysis import stats

PRIMARY, DESIGN, EXPLORATORY = "primary", "design check", "exploratory"
ROLES = (DESIGN, PRIMARY, EXPLORATORY)


@dataclasses.dataclass(frozen=True)
class Question:
  """One question of a seed: its claims by role (claim names, fnmatch patterns for the ones with
  a learning rate or a checkpoint in the name)."""

  key: str
  title: str
  source: str
  primary: tuple[str, ...] = ()
  design: tuple[str, ...] = ()
  exploratory: tuple[str, ...] = ()
  # Whether its design checks are the premise of its primary claims (not read on a grid where
  # the checks computed there all failed: `premise_holds`), or describe the grid only.
  gated: bool = True

  def __post_init__(self):
    if len(self.primary) > 3:
      raise ValueError(f"question {self.key}: {len(self.primary)} primary claims (1-3 allowed)")

  def claims(self, role: str) -> tuple[str, ...]:
    """Its claim names (and patterns) with `role`."""
    return {PRIMARY: self.primary, DESIGN: self.design, EXPLORATORY: self.exploratory}[role]

  def role(self, name: str) -> str | None:
    """The role of claim `name` in this question, None when it is not one of its claims."""
    for role in (PRIMARY, DESIGN, EXPLORATORY):
      if any(fnmatch.fnmatchcase(name, p) for p in self.claims(role)):
        return role
    return None


QUESTIONS = (
    Question(
        "recipe_vs_bf16", "Does the 4-bitter recipe keep BF16's RL training dynamics?",
        "seed 000 (The 4-bitter Lesson: 'a low-precision RL recipe preserving higher-precision "
        "training dynamics'); tested as an equivalence (TOST), paired by seed with the BF16 twin",
        primary=("recipe_equiv_end_pass_at_1", "recipe_equiv_gain", "recipe_equiv_trajectory"),
        design=("rl_gain",),
        exploratory=("recipe_vs_naive_outcome", "trajectory_recipe_vs_naive",
                     "trajectory_growth_recipe_vs_naive")),
    Question(
        "forward_components", "Does each forward component of the recipe (per-token activation "
        "scales, 4/6 block scaling, BF16 last 15% of layers) lower the forward's error?",
        "seed 000 (instability from the forward pass due to policy quantization errors)",
        primary=("ladder_+per_token", "ladder_+4/6", "ladder_+bf16_tail"),
        design=("outliers_raise_naive_kl",),
        exploratory=("outliers_per_token_46_remove_more", "trajectory_+per_token",
                     "trajectory_+4/6", "trajectory_+bf16_tail", "trajectory_nvfp4_recipe"),
        # The outlier check says whether the regime's base has the outliers its (exploratory)
        # outlier claims read; the ladder's claims hold for whatever base a grid has.
        gated=False),
    Question(
        "backward", "Is the dequantized backward better than a quantized one?",
        "seed 000 (instability from the backward pass due to gradient mismatches)",
        primary=("backward_cos_fp32_dequantized_vs_quantized",
                 "backward_heldout_delta_dequantized_vs_quantized"),
        exploratory=("backward_*",)),
    Question(
        "sr_cast", "At a learning rate where BF16 lags FP16, does stochastic rounding of the BF16 "
        "compute cast close the gap?",
        "seed 003 (BF16 catches FP16 in RL post-training: stochastic rounding)",
        primary=("cast_sr_closes_gap_gain", "cast_sr_closes_gap_ref_kl"),
        design=("cast_lag@*",)),
    Question(
        "kl_reset", "Does resetting the KL reference keep more prompts solvable?",
        "seed 003 (a fixed KL reference can collapse the odds of optimal answers); its test is "
        "the simulator's (docs/kl_reset.md); the loop's 30-step rows are a proxy",
        exploratory=("kl_reset_pass_k",)),
)


# The grids the claims are registered for (label: the config module's name), with their config.
# A report that lacks one says so: its registered claims are not tested there (document.py).
GRIDS = {"ablate": "configs/ablate.py", "ablate_regime": "configs/ablate_regime.py"}


def registered(roles: Sequence[str] = (PRIMARY, DESIGN)) -> list[tuple[Question, str, str]]:
  """(question, role, claim name or fnmatch pattern) of every claim registered with one of
  `roles`, in the registry's order (every grid registers the same claims; the settings and
  measurements a grid runs decide which of them it can compute)."""
  return [(q, role, p) for q in QUESTIONS for role in roles for p in q.claims(role)]


@dataclasses.dataclass(frozen=True)
class Margin:
  """An equivalence margin (-delta, delta) of one claim on one grid, and why it is that size."""

  delta: float
  reason: str

  @property
  def bounds(self) -> tuple[float, float]:
    return (-self.delta, self.delta)


# The BF16 RL gain each grid is designed to show (held-out pass@1, end - start, BF16 twin), from
# the committed 5-seed runs that predate this registry (docs/results.md): configs/ablate.py
# 0.048, configs/ablate_regime.py 0.020 (then unresolved on 64 prompts x 4 samples; the design
# check must hold before the regime's equivalence is read). "Keeps BF16's dynamics" is read as:
# the recipe's outcome lies within half of what BF16's RL adds, either way. The trajectory
# margin is a per-token KL: a run that differs from BF16 only in last bits (fp16 compute in
# configs/ablate.py) ends 0.009 nats/token from its twin (committed run), chaos alone; the recipe
# keeps BF16's trajectory if it stays within twice that.
_QUALITY = ("half of BF16's RL gain designed for ({gain} pass@1, the committed 5-seed run): the "
            "recipe keeps BF16's dynamics if its outcome is within half of what RL adds")
_TRAJECTORY = ("twice the trajectory part a last-bit difference reaches (fp16 compute vs its BF16 "
               "twin: 0.009 nats/token at the end of configs/ablate.py's committed run): within "
               "twice the chaos floor of BF16 itself")
MARGINS: dict[str, dict[str, Margin]] = {
    "ablate": {
        "recipe_equiv_end_pass_at_1": Margin(0.024, _QUALITY.format(gain=0.048)),
        "recipe_equiv_gain": Margin(0.024, _QUALITY.format(gain=0.048)),
        "recipe_equiv_trajectory": Margin(0.018, _TRAJECTORY),
    },
    "ablate_regime": {
        "recipe_equiv_end_pass_at_1": Margin(0.010, _QUALITY.format(gain=0.020)),
        "recipe_equiv_gain": Margin(0.010, _QUALITY.format(gain=0.020)),
        # No last-bit arm runs in the regime; the same per-token budget as the toy.
        "recipe_equiv_trajectory": Margin(0.018, _TRAJECTORY + " (the toy's per-token budget: "
                                          "the regime runs no last-bit arm)"),
    },
}


def margin(grid: str, claim: str) -> Margin:
  """The registered margin of `claim` on `grid` (a grid without its own: configs/ablate.py's)."""
  table = MARGINS.get(grid, MARGINS["ablate"])
  if claim not in table:
    raise KeyError(f"no equivalence margin registered for {claim!r} on grid {grid!r}: add it to "
                   "experiments/report/registry.py MARGINS before the run")
  return table[claim]


def classify(name: str) -> tuple[Question, str]:
  """(question, role) of a claim; raises for a claim no question registers."""
  found = [(q, r) for q in QUESTIONS if (r := q.role(name)) is not None]
  if not found:
    raise KeyError(f"claim {name!r} is not registered: add it to a question in "
                   "experiments/report/registry.py (exploratory unless registered before the "
                   "run)")
  return found[0]


@dataclasses.dataclass(frozen=True)
class Judged:
  """A verdict with where it was judged: the grid, the question, the role and the family."""

  grid: str
  question: Question
  role: str
  verdict: stats.Verdict

  @property
  def family(self) -> str:
    return f"{self.grid}/{DESIGN}" if self.role == DESIGN else f"{self.grid}/{self.question.key}"

  def row(self) -> dict:
    return {**self.verdict.row(), "grid": self.grid, "question": self.question.key,
            "role": self.role,
            "family": None if self.role == EXPLORATORY else self.family}


# A primary claim whose question's design checks were computed on its grid and none held: the
# premise it is asked under did not hold there (e.g. BF16 did not learn), so it gets no verdict.
NOT_READ = "not read (design check failed)"


def premise_holds(q: Question, design: Sequence[stats.Verdict]) -> bool:
  """Whether question `q`'s primary claims are read on a grid, given the design checks of `q`
  the grid computed: always when `q` is not gated; else when the grid computed none (it cannot
  check the premise; the report lists the check as not computed) or at least one held (e.g. one
  lr where BF16 lags)."""
  return not q.gated or not design or any(v.verdict == "held" for v in design)


def _exploratory(c: stats.Claim) -> stats.Verdict:
  """An exploratory claim's verdict from its raw p (no family: `p_holm` NaN)."""
  v = stats.verdict_of(c.result.mean, c.result.p, c.direction, equivalence=c.margin is not None)
  return stats.Verdict(c, math.nan, v if v == "not tested" else f"{v} (unadjusted)")


def judge(claims_by_grid: Iterable[tuple[str, Sequence[stats.Claim]]]) -> list[Judged]:
  """Every claim judged in its family: per grid, the design checks together, each question's
  primary claims together (Holm), the exploratory ones alone (raw p). A question whose premise
  fails on the grid (`premise_holds`) has its primary claims marked NOT_READ (no Holm p)
  instead. In the registry's order: grid, then question, then role (design, primary,
  exploratory), then the claims' order."""
  out = []
  for grid, claims in claims_by_grid:
    roles = [(c, *classify(c.name)) for c in claims]
    design = [c for c, _, r in roles if r == DESIGN]
    design_v = dict(zip((c.name for c in design), stats.judge(design)))
    for q in QUESTIONS:
      mine = [(c, r) for c, qq, r in roles if qq is q]
      primary = [c for c, r in mine if r == PRIMARY]
      if premise_holds(q, [design_v[c.name] for c, r in mine if r == DESIGN]):
        primary_v = dict(zip((c.name for c in primary), stats.judge(primary)))
      else:
        primary_v = {c.name: stats.Verdict(c, math.nan, NOT_READ) for c in primary}
      for role in ROLES:
        for c, r in mine:
          if r != role:
            continue
          v = (design_v if r == DESIGN else primary_v).get(c.name) if r != EXPLORATORY else None
          out.append(Judged(grid, q, r, v or _exploratory(c)))
  return out
