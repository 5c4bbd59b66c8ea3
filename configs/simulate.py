"""The simulator sweep: reward against measured drift per correction, the seed's knobs, and the
LR x lag phase diagram (lowrl/asyncrl/sweep.py; the report: lowrl/asyncrl/capacity.py).

  configs/simulate.py           the reduced default (docs/async_sweep.md): sampler BF16 / naive
                                NVFP4 (trainer BF16) x none / TIS x 3 lags, MXFP8 uncorrected,
                                IcePop / VCPO on NVFP4: 7 compiled programs, 21 settings x 3
                                seeds x 150 updates, ~15 min on 2 idle CPU cores
  configs/simulate.py:full      the full grid (1 h 57 min on 2 idle cores, measured below)

`sim` is one simulator setting (lowrl.asyncrl.simulator.default_config); each `*grid` lists the
values of each knob (lowrl.asyncrl.sweep.GRID_KNOBS) and the sweep runs each grid's product, every
setting over `seeds` (one program per seed, so a seed gives the same numbers at any seed
count; a config two points share runs once). Lag and sync interval are
runtime inputs (settings differing only there share one compiled program); every other knob value
compiles its own. Override from the command line, e.g.
  --config.grid.lag="(0, 4)" --config.grid.trainer_recipe="('same',)" --config.sim.rl.steps=200

Token-level MIS with reweighting is IcePop by definition (lowrl.rl.corrections: the same weights),
so the grids run `icepop` and leave `mis` out.
"""
import ml_collections

from lowrl.asyncrl import simulator

VARIANTS = ("reduced", "full")


def get_config(variant: str | None = None) -> ml_collections.ConfigDict:
  variant = variant or "reduced"
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
  c.sim.rl.steps = 150 if variant == "reduced" else 300
  # The trainer policy's greedy held-out eval along the run (time to target).
  c.sim.eval_every = 25
  c.seeds = (0, 1, 2)  # seeds per setting
  c.log_every = 1  # TensorBoard scalars every this many steps

  # Every grid: FIFO schedule, 8 prompts x 8 samples, horizon 6, unless it sweeps them.
  base = dict(schedule=("fifo",), num_prompts=(8,), group_size=(8,), horizon=(6,))
  bf16_trainer = ("bf16",)
  if variant == "reduced":
    # Quantization drift (naive NVFP4 sampler) and staleness drift (lags) of several sizes; the
    # trainer stays BF16 so its own precision does not confound. Uncorrected and TIS first, then
    # a third, smaller quantization drift (MXFP8 sampler), then IcePop and VCPO on the NVFP4
    # sampler (quantization and staleness drift together).
    c.grid = _grid(**base, sampler_recipe=("bf16", "nvfp4_naive"), trainer_recipe=bf16_trainer,
                   correction=("none", "tis"), lag=(0, 2, 6))
    c.mxfp8_grid = _grid(sampler_recipe=("mxfp8",), trainer_recipe=bf16_trainer,
                         correction=("none",), lag=(0, 2, 6))
    c.corr_grid = _grid(sampler_recipe=("nvfp4_naive",), trainer_recipe=bf16_trainer,
                        correction=("icepop", "vcpo"), lag=(0, 2, 6))
    c.grids = ("grid", "mxfp8_grid", "corr_grid")  # run order
    return c

  # The full grid: 52 compiled programs, 148 settings. Measured in one process on 2 idle cores
  # (docs/async_sweep.md): 1 h 57 min = compiles 46 min + runs 58 min + evaluation and bookkeeping
  # 13 min.
  # Every precision sampler-only (trainer BF16) and sampler = trainer ('same'; bf16/bf16 runs
  # once), every correction, lags.
  c.grid = _grid(**base, sampler_recipe=("bf16", "mxfp8", "nvfp4_naive", "nvfp4_recipe"),
                 trainer_recipe=("bf16", "same"), correction=("none", "tis", "icepop", "vcpo"),
                 lag=(0, 2, 8))
  two = dict(sampler_recipe=("bf16", "nvfp4_naive"), trainer_recipe=bf16_trainer)
  # Weight-sync interval (runtime: shares the main grid's programs).
  c.sync_grid = _grid(**two, correction=("none", "tis"), sync_every=(1, 2, 4), lag=(0, 2))
  # Batch size (prompts x group size) and horizon (completion length).
  c.batch_grid = _grid(**two, correction=("none",), num_prompts=(4, 16), group_size=(4, 16),
                       lag=(0, 4))
  c.horizon_grid = _grid(**two, correction=("none",), horizon=(4, 8), lag=(0, 4))
  # The phase diagram: LR x lag x precision, with and without TIS.
  c.phase_grid = _grid(**two, lr=(3e-4, 1e-3, 3e-3), lag=(0, 2, 8), correction=("none", "tis"))
  return c


def _grid(**knobs) -> ml_collections.ConfigDict:
  """One grid: a tuple of values per knob (lowrl.asyncrl.sweep.GRID_KNOBS)."""
  return ml_collections.ConfigDict(knobs)
