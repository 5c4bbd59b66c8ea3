r"""The recipe's forward ladder (experiments/paired.py) on a real checkpoint.

  python -m experiments.real_ladder --config=configs/smollm2.py --batches=2 --out=/tmp/ladder.json

`--batches` rollout batches (the config's rl.num_prompts x rl.group_size, training prompts of
steps 0, 1, ...) are sampled once from the checkpoint in BF16 (the ablation grid's `bf16`
setting, configs/ablate.py, applied to this config); then every rung of paired.LADDER
(nvfp4_naive -> +per_token -> +4/6 -> +bf16_tail, configs/ablate.py's precisions) scores the same
tokens with the same weights, and `paired.forward_ladder` gives per prompt the exact
full-vocabulary KL(rung || BF16) averaged over its completions' positions. Printed: each rung's
mean, and each step of the ladder as a paired difference over prompts (lowrl.analysis: mean with
its t interval, sign-test p; prompts of one batch share nothing but the weights, so the prompt is
the unit). Runs on the host CPU (JAX_PLATFORMS=cpu unless set).
"""
import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import json  # noqa: E402
import time  # noqa: E402

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from absl import app, flags  # noqa: E402
from ml_collections import config_flags  # noqa: E402

from configs import ablate as ablate_config  # noqa: E402
from experiments import paired  # noqa: E402
from lowrl.analysis import stats  # noqa: E402
from lowrl.checkpoints import hf  # noqa: E402
from lowrl.training.setup import build  # noqa: E402
from lowrl.training.trainer import Trainer  # noqa: E402

_CONFIG = config_flags.DEFINE_config_file("config", "configs/smollm2.py")
_BATCHES = flags.DEFINE_integer("batches", 2, "rollout batches sampled in BF16")
_OUT = flags.DEFINE_string("out", "", "JSON file for the per-prompt KLs ('' = print only)")


def main(argv):
  del argv
  start = time.time()
  grid = ablate_config.get_config()
  grid.run = _CONFIG.value
  settings = paired.all_settings(grid)
  seed = int(grid.seeds[0])
  setups = {name: build(settings[name].config(grid.run, seed))
            for name in ("bf16", *paired.LADDER)}
  twin = setups["bf16"]
  params = hf.load_hf_params(twin.base.hf_checkpoint, twin.model_cfg, dtype=jnp.float32)
  trainer = Trainer(twin, log=lambda _: None)
  rollouts = paired.sample_batches(trainer, params, _BATCHES.value)
  print(f"[ladder] sampled {_BATCHES.value} batches in BF16 ({time.time() - start:.0f}s)")
  result = paired.forward_ladder(grid, setups, twin, params, rollouts, log=print)
  kl = result["kl"]
  steps = list(zip(paired.LADDER[:-1], paired.LADDER[1:]))
  for a, b in steps:
    diffs = np.asarray(kl[b]) - np.asarray(kl[a])
    t = stats.paired_t(diffs)
    print(f"[ladder] {a} -> {b}: mean change {t.mean:+.4f} (95% CI {t.ci_low:+.4f} .. "
          f"{t.ci_high:+.4f}), sign test p {stats.sign_test(diffs):.3g}, "
          f"{int((diffs < 0).sum())}/{len(diffs)} prompts lower")
  print(f"[ladder] done in {time.time() - start:.0f}s")
  if _OUT.value:
    with open(_OUT.value, "w") as fh:
      json.dump({**result, "prompts": len(kl[paired.LADDER[0]]),
                 "seconds": time.time() - start}, fh, indent=1)


if __name__ == "__main__":
  app.run(main)
