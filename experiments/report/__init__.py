r"""The ablation's report: docs/results.md with PNG plots, from experiments/ablate.py workdirs.

  python -m experiments.report --workdir=/tmp/lowrl_ablate        # writes docs/results.md
  python -m experiments.report --workdir=W --out=/tmp/results.md   # elsewhere
  python -m experiments.report --workdir=W --workdir=W2           # two grids, one report

With several workdirs (configs/ablate.py's grid and configs/ablate_regime.py's), their claims are
named by grid ("[ablate_regime] ...") and judged as one Holm family; each grid's tables follow.

Every claim is tested as a paired comparison (lowrl.analysis.stats): against a named baseline on
the same unit, a seed of the grid (settings of one seed share the base, prompts, held-out set and
sampling keys) or a prompt / batch of experiments/paired.py's forward-only and backward
measurements (identical tokens and weights for every arm). Per claim: the design, n, the mean
paired difference with its 95% confidence interval (paired t), the Holm-adjusted p over all the
claims of the report (one family), and the verdict at 0.05: held, contradicted (significant the
other way) or not resolved. The PNGs are written next to the markdown file (`<stem>_*.png`, a
second grid's `<stem>_<grid>_*.png`).
"""
