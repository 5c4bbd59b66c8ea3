"""LoRA on the NVFP4 recipe (QeRL's setting, arXiv 2510.11696): the main job (configs/default.py)
with the base frozen and held packed, rank-16 adapters on every linear layer of the blocks, trained
and synced alone (docs/lora.md).

The recipe is the main job's (nvfp4_recipe: the base's matmuls in NVFP4, the adapters' products in
FP32); the base's quantized kernels live packed in the trainer as in the sampler (4-bit codes +
scales, quantized once at load: `lora.packed_base`, bit for bit the run with the base in FP32,
tests/training/test_lora_loop.py). The adapters train at 10x the full fine-tuning learning rate
(2e-3 vs 2e-4): a rank-r update of the same size needs larger steps in A and B, the usual LoRA
practice (QeRL and PEFT's examples run LoRA at several times the full fine-tuning rate). Same as
`--config=configs/default.py --config.lora.rank=16 --config.lora.alpha=32
--config.optimizer.lr=2e-3 --config.lora.packed_base=True`.
"""
from configs import default


def get_config():
  c = default.get_config()
  c.lora.rank = 16
  c.lora.alpha = 32.0
  c.optimizer.lr = 2e-3
  c.lora.packed_base = True
  return c
