"""The simulator sweep: precision (4-bitter included) x correction x lag, plus the LR x lag x
precision phase diagram.

`sim` is one simulator setting (lowrl.asyncrl.simulator.default_config); `grid` and `phase_grid`
list the values of each knob (lowrl.asyncrl.sweep.GRID_KNOBS) and the sweep runs each grid's
product, every setting over `seeds` (vmapped; a config two points share runs once). Override from
the command line, e.g.
  --config.grid.lag="(0, 4)" --config.grid.trainer_recipe="('same',)" --config.sim.rl.steps=200
"""
import ml_collections

from lowrl.asyncrl import simulator


def get_config() -> ml_collections.ConfigDict:
  c = ml_collections.ConfigDict()
  c.sim = simulator.default_config()
  c.sim.task.update(kind="sort", num_symbols=8, length=6, reward="per_token")
  # RL from a weak supervised base (40 steps: held-out greedy 0.60 ± 0.03), at a learning rate
  # where the on-policy run improves clearly (BF16, lag 0: greedy 0.79 ± 0.02 after 300 updates,
  # 4 seeds; from a 100-step base, 0.87 -> 0.91 ± 0.03, within noise) but staleness has room to
  # hurt (lr 3e-3 collapses from the 100-step base: 0.87 -> 0.68 ± 0.12).
  c.sim.sft.steps = 40
  c.sim.optimizer.lr = 1e-3
  c.sim.rl.steps = 300
  c.seeds = (0, 1, 2)  # seeds per setting (vmapped)
  c.log_every = 1  # TensorBoard scalars every this many steps

  c.grid = ml_collections.ConfigDict()
  # Off-policy lags (trainer steps); 'auto' = the cost model's lag of the modelled system.
  c.grid.lag = (0, 2, "auto")
  c.grid.schedule = ("fifo",)  # fifo | pipeline | length | independent
  # Sampler-only NVFP4 (trainer BF16) next to the 4-bitter setting (sampler = trainer recipe).
  c.grid.sampler_recipe = ("bf16", "nvfp4_naive", "nvfp4_recipe")  # sampler precision recipes
  c.grid.trainer_recipe = ("bf16", "same")  # trainer precision recipes ('same' = the sampler's)
  c.grid.correction = ("none", "tis")  # none | tis | mis
  c.grid.num_prompts = (8,)  # prompts per batch
  c.grid.group_size = (8,)  # samples per prompt
  c.grid.horizon = (6,)  # completion lengths (task.length)

  # The correction capacity: where reward collapses over LR x lag, per precision, with and
  # without TIS (summary.md's phase diagram and phase.png).
  c.phase_grid = ml_collections.ConfigDict()
  c.phase_grid.lr = (3e-4, 1e-3, 3e-3)  # learning rates of the phase diagram
  c.phase_grid.lag = (0, 2, 8)  # lags of the phase diagram
  c.phase_grid.sampler_recipe = ("bf16", "nvfp4_recipe")  # samplers of the phase diagram
  c.phase_grid.trainer_recipe = ("bf16",)  # trainer of the phase diagram
  c.phase_grid.correction = ("none", "tis")  # corrections of the phase diagram
  return c
