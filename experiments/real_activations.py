r"""Activation statistics of a real checkpoint on its task's prompts, beside the regime's planted
outlier channels (docs/ablation.md, "A regime where the effects can appear").

  python -m experiments.real_activations --config=configs/smollm2.py --out=/tmp/real_acts.json

The same measurement as experiments/regime.py's outlier probe (lowrl.training.outliers
.channel_stats: on the normed inputs of every layer's q/k/v and gate/up matmuls, over the real
tokens of `--prompts` held-out prompts with their reference answers, one unquantized FP32
forward): the largest per-channel max |activation| over the median channel's, the kurtosis, the
top channel. Prints per layer and the medians / ranges over norms, and writes them to --out.
Runs on the host CPU (JAX_PLATFORMS=cpu unless set).
"""
import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import json  # noqa: E402
import time  # noqa: E402

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from absl import app, flags  # noqa: E402
from ml_collections import config_flags  # noqa: E402

from lowrl.checkpoints import hf  # noqa: E402
from lowrl.tasks.batching import encode_sft  # noqa: E402
from lowrl.training import outliers  # noqa: E402
from lowrl.training.setup import build  # noqa: E402

_CONFIG = config_flags.DEFINE_config_file("config", "configs/smollm2.py")
_PROMPTS = flags.DEFINE_integer("prompts", 32, "held-out prompts (with their answers)")
_OUT = flags.DEFINE_string("out", "", "JSON file for the statistics ('' = print only)")


def main(argv):
  del argv
  start = time.time()
  setup = build(_CONFIG.value)
  task = setup.task
  exs = task.examples("eval")[:_PROMPTS.value]
  tokens, mask = encode_sft(task.tokenizer, [e.prompt for e in exs],
                            [task.target_text(e) for e in exs],
                            task.max_prompt_len + task.max_answer_len + 1)
  real = jnp.asarray(tokens != task.tokenizer.pad_id)
  params = hf.load_hf_params(setup.base.hf_checkpoint, setup.model_cfg, dtype=jnp.float32)
  stats = outliers.channel_stats(params, jnp.asarray(tokens), real, setup.model_cfg)
  for name, s in stats.items():
    print(f"[acts] {name:22s} max/median {s['max_over_median']:7.1f}  kurtosis "
          f"{s['kurtosis']:8.1f}  top channel {s['top']}")
  summary = {}
  for norm in outliers.READERS:
    ratio = [s["max_over_median"] for k, s in stats.items() if k.endswith(norm)]
    kurt = [s["kurtosis"] for k, s in stats.items() if k.endswith(norm)]
    tops = [s["top"] for k, s in stats.items() if k.endswith(norm)]
    summary[norm] = {"max_over_median": [float(np.min(ratio)), float(np.median(ratio)),
                                         float(np.max(ratio))],
                     "kurtosis": [float(np.min(kurt)), float(np.median(kurt)),
                                  float(np.max(kurt))],
                     "top_channels": sorted(set(tops))}
    print(f"[acts] {norm}: max/median min {np.min(ratio):.1f} median {np.median(ratio):.1f} max "
          f"{np.max(ratio):.1f}; kurtosis min {np.min(kurt):.1f} median {np.median(kurt):.1f} "
          f"max {np.max(kurt):.1f}; top channels {sorted(set(tops))}")
  n_tokens = int(np.asarray(real).sum())
  print(f"[acts] {n_tokens} tokens, {len(exs)} prompts, {time.time() - start:.0f}s")
  if _OUT.value:
    with open(_OUT.value, "w") as fh:
      json.dump({"tokens": n_tokens, "prompts": len(exs), "per_norm": stats,
                 "summary": summary}, fh, indent=1)


if __name__ == "__main__":
  app.run(main)
