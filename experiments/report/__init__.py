r"""The ablation's report: docs/results.md with PNG plots, from experiments/ablate.py workdirs.

  python -m experiments.report --workdir=/tmp/lowrl_ablate        # writes docs/results.md
  python -m experiments.report --workdir=W --out=/tmp/results.md   # elsewhere
  python -m experiments.report --workdir=W --workdir=W2           # two grids, one report

With several workdirs (configs/ablate.py's grid and configs/ablate_regime.py's), their claims are
named by grid ("[ablate_regime] ...") and each grid's tables follow.

One module per question of the seeds, each with its claims and its sections:
  recipe_vs_bf16  the recipe keeps BF16's dynamics (equivalence, TOST) and the distance to BF16;
  components      the forward components (the forward ladder, outlier channels, the build-up);
  backward        the backward modes (identical batches; the training probes);
  sr_cast         stochastic rounding of the BF16 compute cast;
and registry (which claims are primary, design checks or exploratory, and the equivalence
margins, fixed before the runs), claims (every claim of a grid), common (per-run values and the
seed-paired claim), descriptive (the sections no claim reads), grids (one grid's data, header and
body), document (the markdown file and its claims JSON).

Every claim is a paired comparison (lowrl.analysis.stats): against a named baseline on the same
unit, a seed of the grid (settings of one seed share the base, prompts, held-out set and sampling
keys) or a prompt / batch of experiments/paired.py's forward-only and backward measurements
(identical tokens and weights for every arm). Per claim: the design, n, the mean paired
difference with its 95% interval (paired t over seeds or batches; a batch-clustered bootstrap
for per-prompt KLs; an equivalence claim's TOST with its 90% interval), p, the Holm-adjusted p in
its family (per grid: each question's primary claims; the design checks) or none (exploratory),
and the verdict at 0.05. The PNGs are written next to the markdown file (`<stem>_*.png`, a second
grid's `<stem>_<grid>_*.png`).
"""
