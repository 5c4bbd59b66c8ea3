"""The simulator sweep's grid knobs: the config field each sets, and its short name in setting
names (lowrl.asyncrl.sweep builds settings from them; lowrl.asyncrl.report labels contexts)."""

# Grid knob -> the simulator config field it sets. Settings iterate with the first knobs
# outermost: lag and sync interval last, since they only change the (runtime) ring plan and so
# share one compiled program.
GRID_KNOBS = {
    "sampler_recipe": "sampler_recipe",
    "trainer_recipe": "trainer_recipe",  # "same" = the sampler's recipe
    "act_per_token": "recipe.act_per_token",
    "four_over_six": "recipe.four_over_six",
    "bf16_last_fraction": "recipe.bf16_last_fraction",
    "backward": "recipe.backward",
    "lr": "optimizer.lr",
    "old_logp_source": "rl.old_logp_source",
    "correction": "rl.correction",
    "num_prompts": "rl.num_prompts",
    "group_size": "rl.group_size",
    "horizon": "task.length",
    "sampler_devices": "cost.sampler_devices",
    "schedule": "async_rl.schedule",
    "lag_distribution": "async_rl.lag_distribution",
    "sync_every": "async_rl.sync_every",
    "lag": "async_rl.lag",  # an int or "auto" (the cost model's)
}
SHORT = {"sampler_recipe": "s", "trainer_recipe": "t", "act_per_token": "ptok",
         "four_over_six": "46", "bf16_last_fraction": "tail", "backward": "bwd", "lr": "lr",
         "old_logp_source": "old", "correction": "corr", "num_prompts": "np",
         "group_size": "g", "horizon": "h", "sampler_devices": "sdev", "schedule": "sched",
         "lag_distribution": "dist", "sync_every": "sync", "lag": "lag"}
