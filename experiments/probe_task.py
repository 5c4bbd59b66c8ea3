r"""pass@1 of a checkpoint on a few held-out prompts of a JSONL task (how configs/smollm2.py's task
was chosen: the base's pass@1 should leave RL room, between 0.1 and 0.7).

  python -m experiments.probe_task --config=configs/smollm2.py --prompts=16 --samples=4
  python -m experiments.probe_task --config=configs/smollm2.py:bf16 --prompts=0 --samples=8 \
      --keys=3 --config.rl.temperature=0.7        # every eval prompt, 3 sampling keys

Builds the run's setup (no training program is compiled), then samples `--samples` completions
of each of the first `--prompts` eval prompts (0: all of them, each once, in file order) at the
config's temperature with its sampler precision, plus one greedy completion, through lowrl's
sampler; prints pass@1 (mean reward of the samples) with its t interval over the prompts, greedy
accuracy and a few completions. With `--keys` > 1 the sampled design is repeated under keys
0..keys-1 (key 0 is the single-key run's): one draw of 16 prompts x 4 samples is noisy (on
SmolLM2 its pass@1 ranged 0.016-0.156 over 12 keys, docs/real_model.md), and the spread over keys
says how much. `--out` writes the per-prompt solved fractions as JSON. Runs on the host CPU
unless JAX_PLATFORMS is set.
"""
import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import json  # noqa: E402
import time  # noqa: E402
from typing import Sequence  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from absl import app, flags  # noqa: E402
from ml_collections import config_flags  # noqa: E402

from experiments.probe_summary import summary  # noqa: E402
from lowrl.checkpoints import hf  # noqa: E402
from lowrl.sampling.generate import generate  # noqa: E402
from lowrl.tasks import batching  # noqa: E402
from lowrl.training.setup import build  # noqa: E402

_CONFIG = config_flags.DEFINE_config_file("config", "configs/smollm2.py")
_PROMPTS = flags.DEFINE_integer("prompts", 16, "eval prompts to probe; 0 = all, each once")
_SAMPLES = flags.DEFINE_integer("samples", 4, "samples per prompt at the config's temperature")
_KEYS = flags.DEFINE_integer("keys", 1, "sampling keys 0..keys-1 the sampled design is run under")
_OUT = flags.DEFINE_string("out", "", "JSON file for the per-prompt solved fractions; '' = none")


def _rewards(setup, params, examples: Sequence, n: int, cfg, key: jax.Array) -> np.ndarray:
  """[len(examples), n] rewards of n completions per prompt (one batch) and their texts."""
  task, tok = setup.task, setup.task.tokenizer
  rows = [e for e in examples for _ in range(n)]
  tokens, lens = batching.encode_prompts(tok, [e.prompt for e in rows], task.max_prompt_len)
  mask = np.arange(tokens.shape[1])[None, :] < lens[:, None]
  out, _ = generate(params, jnp.asarray(tokens), jnp.asarray(mask), key,
                    model_cfg=setup.model_cfg, policy=setup.sampler_policy, config=cfg)
  tokens = np.asarray(out.tokens)
  texts = batching.decode_batch(tok, tokens, np.full((tokens.shape[0],), out.prompt_width))
  return task.rewards(texts, rows).reshape(len(examples), n), texts


def main(argv):
  del argv
  if _PROMPTS.value < 0 or _SAMPLES.value < 1 or _KEYS.value < 1:
    raise app.UsageError("--prompts >= 0 (0 = all), --samples >= 1 and --keys >= 1.")
  start = time.time()
  setup = build(_CONFIG.value)
  examples = setup.task.examples("eval")
  examples = examples[:_PROMPTS.value] if _PROMPTS.value else examples
  params = hf.load_hf_params(setup.base.hf_checkpoint, setup.model_cfg,
                             dtype=jnp.dtype(setup.base.param_dtype))
  greedy, greedy_texts = _rewards(setup, params, examples, 1, setup.eval_sampling,
                                  jax.random.key(0))
  sampled, texts = [], []
  for k in range(_KEYS.value):
    r, t = _rewards(setup, params, examples, _SAMPLES.value, setup.sampling, jax.random.key(k))
    sampled.append(r)
    texts = texts or t[:4]
    print(f"[probe] key {k}: pass@1 {r.mean():.3f}", flush=True)
  s = summary(np.stack(sampled))
  print(f"[probe] greedy: {greedy.mean():.3f} over {len(examples)} prompts; e.g. {greedy_texts[:4]}")
  print(f"[probe] sampled: e.g. {texts}")
  spread = f", sd over {_KEYS.value} keys {s['key_sd']:.3f}" if _KEYS.value > 1 else ""
  print(f"[probe] pass@1 {s['pass_at_1']:.3f} [{s['ci_low']:.3f}, {s['ci_high']:.3f}] "
        f"({len(examples)} prompts x {_SAMPLES.value} samples x {_KEYS.value} keys, T = "
        f"{setup.sampling.temperature:g}{spread}), greedy {greedy.mean():.3f} "
        f"({time.time() - start:.0f}s)")
  if _OUT.value:
    with open(_OUT.value, "w") as f:
      json.dump({**s, "greedy": greedy[:, 0].tolist(), "temperature": setup.sampling.temperature,
                 "samples": _SAMPLES.value, "prompts": [e.prompt for e in examples],
                 "sampled_per_key_prompt": [r.mean(axis=1).tolist() for r in sampled]}, f,
                indent=1)


if __name__ == "__main__":
  app.run(main)
