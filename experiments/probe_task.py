r"""pass@1 of a checkpoint on a few held-out prompts of a JSONL task (how configs/smollm2.py's task
was chosen: the base's pass@1 should leave RL room, between 0.1 and 0.7).

  python -m experiments.probe_task --config=configs/smollm2.py --prompts=16 --samples=4

Builds the run's setup (no training program is compiled), then samples `--samples` completions
of each of the first `--prompts` eval prompts at the config's temperature with its sampler
precision, plus one greedy completion, through lowrl's sampler; prints pass@1 (mean reward of the
samples), greedy accuracy and a few completions. Runs on the host CPU unless JAX_PLATFORMS is set.
"""
import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import time  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from absl import app, flags  # noqa: E402
from ml_collections import config_flags  # noqa: E402

from lowrl.checkpoints import hf  # noqa: E402
from lowrl.sampling.generate import generate  # noqa: E402
from lowrl.tasks import batching  # noqa: E402
from lowrl.training.setup import build  # noqa: E402

_CONFIG = config_flags.DEFINE_config_file("config", "configs/smollm2.py")
_PROMPTS = flags.DEFINE_integer("prompts", 16, "eval prompts to probe")
_SAMPLES = flags.DEFINE_integer("samples", 4, "samples per prompt at the config's temperature")


def main(argv):
  del argv
  start = time.time()
  setup = build(_CONFIG.value)
  task, tok = setup.task, setup.task.tokenizer
  examples = task.examples("eval")[:_PROMPTS.value]
  params = hf.load_hf_params(setup.base.hf_checkpoint, setup.model_cfg,
                             dtype=jnp.dtype(setup.base.param_dtype))
  prompts = [e.prompt for e in examples]
  results = {}
  for name, cfg, n in (("greedy", setup.eval_sampling, 1), ("sampled", setup.sampling,
                                                             _SAMPLES.value)):
    rows = [p for p in prompts for _ in range(n)]
    tokens, lens = batching.encode_prompts(tok, rows, task.max_prompt_len)
    mask = np.arange(tokens.shape[1])[None, :] < lens[:, None]
    out, _ = generate(params, jnp.asarray(tokens), jnp.asarray(mask),
                               jax.random.key(0), model_cfg=setup.model_cfg,
                               policy=setup.sampler_policy, config=cfg)
    tokens = np.asarray(out.tokens)
    texts = batching.decode_batch(tok, tokens, np.full((tokens.shape[0],), out.prompt_width))
    rewards = task.rewards(texts, [e for e in examples for _ in range(n)])
    results[name] = (float(np.mean(rewards)), texts[:4])
  for name, (score, texts) in results.items():
    print(f"[probe] {name}: {score:.3f} over {len(prompts)} prompts; e.g. {texts}")
  print(f"[probe] pass@1 {results['sampled'][0]:.3f}, greedy {results['greedy'][0]:.3f} "
        f"({time.time() - start:.0f}s)")


if __name__ == "__main__":
  app.run(main)
