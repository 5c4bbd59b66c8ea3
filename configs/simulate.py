"""The simulator sweep, designed around its questions (lowrl/asyncrl/sweep.py; the report:
lowrl/asyncrl/capacity.py, lowrl/asyncrl/report.py).

Questions, and the settings each needs (main context: sort 6 of 8, 8 prompts x 8 samples,
horizon 6, lr 1e-3, FIFO; trainer BF16 unless said):
  Q1 does quantization drift cost like staleness drift at equal total drift? Uncorrected rows
     whose quantization share of the drift ranges 0 -> 1: BF16 sampler at lags 2, 8 (staleness
     alone), MXFP8 / naive NVFP4 samplers at lag 0 (quantization alone) and at lags 2, 8 (both).
  Q2 how much drift does each correction absorb (correction capacity)? Every correction (none,
     TIS, IcePop, VCPO) on the SAME drifted settings: the 8 rows of Q1 with drift, so a capacity
     is a property of the correction, not of its pool. The BF16 lag-0 run is the shared
     zero-drift anchor; BF16 lag 0 under a correction is the anchor itself (sampler = trainer,
     every weight 1: zero drift by construction) and is not run.
  Q3 what does training in the format cost, apart from drift? Sampler = trainer in MXFP8, naive
     NVFP4, the 4-bitter recipe, uncorrected, lags 0, 2, 8: at lag 0 their drift is the
     quantization of the sampler's static scales alone (0 for row-scaled recipes), so their gap
     to BF16 there is the format's own cost (their own rows in the capacity report).
The LR x lag phase diagram, sync interval, batch and horizon sweeps of the earlier 148-setting
grid are gone: they answered none of these (and at 3 seeds could not resolve their cells).

  configs/simulate.py           quick (the default): the same path and grids on a subset that
                                answers Q1-Q3 coarsely: samplers BF16 / naive NVFP4, none / TIS,
                                lags 0, 2, 8, the recipe trained in the format at lags 0, 2:
                                13 settings, 5 compiled programs, 8 seeds x 100 updates
  configs/simulate.py:full      Q1-Q3 in full: 42 settings, 15 compiled programs, 10 seeds x
                                300 updates (2.76 h at nice 19 on 2 shared cores: docs/async.md)

`sim` is one simulator setting (lowrl.asyncrl.simulator.default_config()); each `*grid` lists the
values of each knob (lowrl.asyncrl.sweep.GRID_KNOBS) and the sweep runs each grid's product, every
setting over `seeds` (one program per seed, so a seed gives the same numbers at any seed
count; a config two points share runs once). Lag and sync interval are
runtime inputs (settings differing only there share one compiled program); every other knob value
compiles its own. Override from the command line, e.g.
  --config.grid.lag="(0, 4)" --config.seeds="(0, 1, 2)" --config.sim.rl.steps=200

Token-level MIS with reweighting is IcePop by definition (lowrl.rl.corrections: the same weights),
so the grids run `icepop` and leave `mis` out.
"""
import ml_collections

from lowrl.asyncrl import simulator

VARIANTS = ("quick", "full")
SEEDS = {"quick": 8, "full": 10}  # fixed before any run (docs/async.md: seed-count history)


def get_config(variant: str | None = None) -> ml_collections.ConfigDict:
  variant = variant or "quick"
  if variant not in VARIANTS:
    raise ValueError(f"configs/simulate.py:{variant}: use one of {VARIANTS}.")
  c = ml_collections.ConfigDict()
  c.variant = variant
  c.sim = simulator.default_config()
  c.sim.task.update(kind="sort", num_symbols=8, length=6, reward="per_token")
  # RL from a weak supervised base (40 steps: held-out greedy 0.60 ± 0.03), at a learning rate
  # where the on-policy run improves clearly (BF16, lag 0: greedy 0.79 ± 0.02 after 300 updates,
  # 4 seeds) but staleness has room to hurt (lr 3e-3 collapses from a 100-step base).
  c.sim.sft.steps = 40
  c.sim.optimizer.lr = 1e-3
  c.sim.rl.steps = 100 if variant == "quick" else 300
  # The trainer policy's greedy held-out eval along the run (time to target).
  c.sim.eval_every = 25
  c.seeds = tuple(range(SEEDS[variant]))
  c.log_every = 1  # TensorBoard scalars every this many steps

  # Every grid: FIFO schedule, 8 prompts x 8 samples, horizon 6, BF16 trainer unless it says.
  main = dict(schedule=("fifo",), num_prompts=(8,), group_size=(8,), horizon=(6,),
              trainer_recipe=("bf16",))
  lags = (0, 2, 8)
  if variant == "quick":
    quantized, corrections, format_recipes, format_lags = ("nvfp4_naive",), ("tis",), \
        ("nvfp4_recipe",), (0, 2)
  else:
    quantized, corrections, format_recipes, format_lags = ("mxfp8", "nvfp4_naive"), \
        ("tis", "icepop", "vcpo"), ("mxfp8", "nvfp4_naive", "nvfp4_recipe"), lags
  # Q1 (and Q2's uncorrected rows): staleness alone, quantization alone, both.
  c.grid = _grid(**main, sampler_recipe=("bf16",) + quantized, correction=("none",), lag=lags)
  # Q2: every correction on the drifted settings of `grid` (no zero-drift copies).
  c.corr_grid = _grid(**main, sampler_recipe=quantized, correction=corrections, lag=lags)
  c.stale_corr_grid = _grid(**main, sampler_recipe=("bf16",), correction=corrections,
                            lag=tuple(l for l in lags if l > 0))
  # Q3: trained in the format (sampler = trainer), uncorrected.
  c.format_grid = _grid(**{**main, "trainer_recipe": ("same",)}, sampler_recipe=format_recipes,
                        correction=("none",), lag=format_lags)
  c.grids = ("grid", "corr_grid", "stale_corr_grid", "format_grid")  # run order
  return c


def _grid(**knobs) -> ml_collections.ConfigDict:
  """One grid: a tuple of values per knob (lowrl.asyncrl.sweep.GRID_KNOBS)."""
  return ml_collections.ConfigDict(knobs)
