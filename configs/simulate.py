"""The simulator sweep: off-policy lag x precision recipe x mismatch correction.

`sim` is one simulator setting (lowrl.asyncrl.simulator.default_config); `grid` lists the values of
each knob (lowrl.asyncrl.sweep.GRID_KNOBS) and the sweep runs their product, every setting over
`seeds` (vmapped). Override from the command line, e.g.
  --config.grid.lag="(0, 4)" --config.grid.trainer_recipe="('same',)" --config.sim.rl.steps=200
"""
import ml_collections

from lowrl.asyncrl import simulator


def get_config() -> ml_collections.ConfigDict:
  c = ml_collections.ConfigDict()
  c.sim = simulator.default_config()
  c.sim.task.update(kind="sort", num_symbols=8, length=6, reward="per_token")
  # RL from a supervised base with a modest reward (REFERENCE.md §5), at a learning rate where
  # the on-policy run still improves but staleness has room to hurt.
  c.sim.sft.steps = 100
  c.sim.optimizer.lr = 1e-3
  c.sim.rl.steps = 400
  c.seeds = (0, 1, 2, 3)  # seeds per setting (vmapped)
  c.log_every = 1  # TensorBoard scalars every this many steps

  c.grid = ml_collections.ConfigDict()
  c.grid.lag = (0, 1, 2, 4, 8)  # off-policy lags (trainer steps) to sweep
  c.grid.sync_every = (1,)  # weight-sync intervals to sweep
  c.grid.lag_distribution = ("fixed",)  # fixed | uniform | geometric lag draws
  # The paper's setting: the sampler quantized, the trainer in BF16 ("same" = the sampler's).
  c.grid.sampler_recipe = ("bf16", "nvfp4_naive", "nvfp4_recipe")  # sampler precision recipes
  c.grid.trainer_recipe = ("bf16",)  # trainer precision recipes ('same' = the sampler's)
  c.grid.correction = ("none", "tis")  # none | tis | mis
  c.grid.num_prompts = (8,)  # prompts per batch
  c.grid.group_size = (8,)  # samples per prompt
  c.grid.horizon = (6,)  # completion lengths (task.length)
  return c
