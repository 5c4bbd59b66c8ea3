"""LoRA on the NVFP4 recipe (QeRL's setting, arXiv 2510.11696): the main job with the base frozen
and rank-16 adapters on every linear layer of the blocks, trained and synced alone (docs/lora.md).

The recipe is the main job's (configs/nvfp4_recipe.py: the base's matmuls in NVFP4, the adapters'
products in FP32); the adapters train at 10x the full fine-tuning learning rate (2e-3 vs 2e-4):
a rank-r update of the same size needs larger steps in A and B, the usual LoRA practice (QeRL
and PEFT's examples run LoRA at several times the full fine-tuning rate). Same as
`--config=configs/base.py:nvfp4_recipe --config.lora.rank=16 --config.lora.alpha=32
--config.optimizer.lr=2e-3`.
"""
from configs import base


def get_config():
  c = base.get_config("nvfp4_recipe")
  c.lora.rank = 16
  c.lora.alpha = 32.0
  c.optimizer.lr = 2e-3
  return c
