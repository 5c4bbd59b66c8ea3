"""A regime of the recipe ablation where low-precision effects can appear (issue 24, point 4).

configs/ablate.py's toy is 8 layers at d = 64 (a 16-element NVFP4 block is a quarter of a row),
completions of about 8 tokens, 30 RL steps and no outlier channels, so the static forward error
dominates every end-of-run number. This config changes the run, nothing else of the grid:
  - width: d = 256 (16 NVFP4 blocks per row), 4 layers (the BF16 tail = the last one);
  - completions of 64-65 tokens: sorting 63-64 symbols of "abcd" (the answer is 4 runs of
    letters whose lengths the model must count; the budget of 72 leaves room to overrun);
  - 300 RL updates (rl.mu = 1, one minibatch: one update per step), with the checkpoints at 25%
    and 50% kept for experiments/paired.py's distance and the code churn logged every step;
  - outlier channels: 4 evenly spaced channels (one per 64, each in a 16-block of its own) whose
    RMSNorm gains are x16 in every layer, the q/k/v and gate/up kernel rows that read them / 16
    (sft.outlier_channels, lowrl/training/outliers.py: the same function in exact arithmetic; the
    matmuls' inputs get a few channels ~16x the others, as trained LLMs' massive activations do).
    `python -m experiments.regime --workdir=W --config=configs/ablate_regime.py` shows them
    (per-channel max |activation| over the median channel's, kurtosis, planted vs not) and
    times a few updates of each setting to size the grid (docs/ablation.md, "A regime where the
    effects can appear").
The whole grid at 5 seeds does not fit 2.5 hours on 2 CPU cores (docs/ablation.md has the
measured cost); `groups` keeps the recipe group, `only` its build-up, the subset the claims of
the trajectory part need.
"""
from __future__ import annotations

import ml_collections

from configs import ablate


def get_config() -> ml_collections.ConfigDict:
  c = ablate.get_config()
  c.seeds = (0, 1, 2, 3, 4)
  c.groups = ("recipe",)
  c.only = ("nvfp4_naive", "+per_token", "+4/6", "+bf16_tail", "nvfp4_recipe")
  c.sr_travel = 0.0
  r = c.run
  r.model.update(d_model=256, n_layers=4, n_heads=4, n_kv_heads=2, head_dim=64, d_ff=768,
                 scan_layers=True)
  r.task.kwargs = ml_collections.ConfigDict({"min_len": 63, "max_len": 64, "alphabet": "abcd"})
  r.sft.update(steps=300, batch_size=32, seed=0, outlier_channels=4, outlier_gain=16.0)
  r.rl.update(steps=300, num_prompts=8, group_size=8, max_new_tokens=72)
  r.eval_num_prompts = 64
  r.eval_samples = 4
  r.diagnostics.every = 50
  r.checkpoint_every = 50
  # experiments/regime.py: the timed RL steps per setting (the first is mostly compiling) and the
  # SFT steps of the base they run from (timing only: the regime's base is sft.steps).
  c.timing = ml_collections.ConfigDict(dict(rl_steps=4, sft_steps=4,
                                            settings=("bf16", "nvfp4_naive", "nvfp4_recipe")))
  return c
