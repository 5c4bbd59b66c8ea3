"""The recipe ablation of experiments/ablate.py: a grid of settings of the real training loop.

`run` is one training run (configs/base.py's schema; its precision is replaced per setting), shared
by every setting: an 8-layer decoder on sorting 3-6 letters, one mid-trained base for every
setting and seed (`run.sft.seed`), the probes on (`run.diagnostics.every`). `groups` chooses which
parts of the grid run (experiments/ablate.py `settings` lists them); `seeds` run for every
setting; `twin` is the setting every run's policy is compared with (KL to the BF16 twin); `lrs`
the learning rates of the stochastic-rounding group. `quick=True` is a small grid at small sizes
(9 minutes on 2 idle CPU cores, measured) that exercises every part; the other
values are then ignored.

`grid` is the grid as data, one row per setting: {"name", "group", "overrides"}, where
`overrides` maps dotted paths of `run` to values, applied in order to a copy of `run`:
"precision" (a recipe name of lowrl/recipes.py) replaces run.precision by that recipe, then
"precision.<knob>" change it ("precision.name" labels the changed recipe), any other path
(`sampler_precision.recipe`, `optimizer.lr`, ...) is set as `--config.run.<path>` would. (The
rows equal what experiments/ablate.py `settings` builds; the runner reads them from here.)
"""
from __future__ import annotations

import ml_collections

from configs import base


def _lr_tag(lr: float) -> str:
  return f"{lr:.0e}".replace("e-0", "e-")


def grid(lrs: tuple[float, ...], fp16_loss_scale: float, kl_coef: float,
         ref_reset_every: int) -> tuple[dict, ...]:
  """The ablation's settings as rows {name, group, overrides} (the module docstring says how a
  row applies)."""
  scale = {"optimizer.loss_scale": float(fp16_loss_scale)}  # every FP16-compute setting
  pt = {"precision": "nvfp4_naive", "precision.act_per_token": True}  # + per-token act scales
  pt46 = {**pt, "precision.four_over_six": True}  # + 4/6 block scaling
  recipe = [
      ("fp32", {"precision": "fp32"}),
      ("bf16", {"precision": "bf16"}),
      ("fp16", {"precision": "fp16", **scale}),
      ("mxfp8", {"precision": "mxfp8"}),
      ("nvfp4_naive", {"precision": "nvfp4_naive"}),
      # The 4-bitter recipe built up one component at a time.
      ("+per_token", {**pt, "precision.name": "nvfp4_pt"}),
      ("+4/6", {**pt46, "precision.name": "nvfp4_pt_46"}),
      ("+bf16_tail", {**pt46, "precision.bf16_last_fraction": 0.15,
                      "precision.name": "nvfp4_pt_46_tail"}),
      ("nvfp4_recipe", {"precision": "nvfp4_recipe"}),  # + dequantized backward
      ("nvfp4_recipe_qbwd", {"precision": "nvfp4_recipe", "precision.backward": "quantized",
                             "precision.name": "nvfp4_recipe_qbwd"}),
  ]
  # The trainer in BF16, the sampler in a low-precision recipe.
  sampler_only = [(f"s={s}/t=bf16", {"precision": "bf16", "sampler_precision.recipe": s})
                  for s in ("mxfp8", "nvfp4_naive", "nvfp4_recipe")]
  # Master weights at each learning rate: FP32, BF16 rounded to nearest, BF16 stochastic, FP16.
  sr = [row for lr in lrs for row in (
      (f"fp32_master@{_lr_tag(lr)}", {"precision": "bf16", "optimizer.lr": float(lr)}),
      (f"bf16_rtn@{_lr_tag(lr)}", {"precision": "bf16", "optimizer.lr": float(lr),
                                   "optimizer.master_dtype": "bfloat16"}),
      (f"bf16_sr@{_lr_tag(lr)}", {"precision": "bf16", "optimizer.lr": float(lr),
                                  "optimizer.master_dtype": "bfloat16",
                                  "optimizer.master_rounding": "stochastic"}),
      (f"fp16@{_lr_tag(lr)}", {"precision": "fp16", "optimizer.lr": float(lr), **scale}))]
  kl = {"precision": "bf16", "rl.kl_coef": float(kl_coef)}
  kl_reset = [("kl", kl), ("kl+reset", {**kl, "rl.ref_reset_every": int(ref_reset_every)})]
  groups = {"recipe": recipe, "sampler_only": sampler_only, "sr": sr, "kl_reset": kl_reset}
  return tuple({"name": name, "group": group, "overrides": overrides}
               for group, rows in groups.items() for name, overrides in rows)


def get_config() -> ml_collections.ConfigDict:
  c = ml_collections.ConfigDict()
  c.quick = False  # small grid, small sizes: a smoke test of the whole experiment
  c.seeds = (0, 1, 2)  # every setting runs every seed (the same base)
  c.groups = ("recipe", "sampler_only", "sr", "kl_reset")  # parts of the grid to run
  c.only = ()  # setting names to run (within `groups`); () = all
  c.twin = "bf16"  # the setting whose policy (same seed) every run is compared with
  # Stochastic-rounding group: BF16 RTN erases updates at the low end; the first is run.optimizer.lr
  # (its fp32_master setting is the bf16 setting: one run).
  c.lrs = (2e-4, 2e-5, 2e-6)
  c.fp16_loss_scale = 1024.0  # static loss scale of every FP16-compute setting
  c.kl_coef = 0.05  # KL reference reset group: beta of the KL penalty
  c.ref_reset_every = 10  # KL reference reset group: steps between pi_ref resets
  c.grid = grid(c.lrs, c.fp16_loss_scale, c.kl_coef, c.ref_reset_every)

  run = base.get_config("bf16")
  # 8 layers: the BF16 tail (15%) is one layer; scanned so compile time does not grow with depth.
  run.model.update(d_model=64, n_layers=8, n_heads=4, n_kv_heads=2, head_dim=16, d_ff=192,
                   scan_layers=True)
  # One base for every seed. 100 steps leave it at held-out pass@1 ~0.37 (300 steps: 0.81, where
  # RL had too little left to gain to show above the seed spread).
  run.sft.update(steps=100, batch_size=64, seed=0)
  run.rl.update(steps=30, num_prompts=16, group_size=8)
  run.optimizer.lr = 2e-4  # bf16, seeds 0-2: pass@1 0.350 -> 0.399 (gain 0.049 +- 0.010)
  run.eval_num_prompts = 128
  run.eval_samples = 4
  run.diagnostics.every = 5
  run.checkpoint_every = 10
  run.num_text_samples = 0
  c.run = run
  return c
