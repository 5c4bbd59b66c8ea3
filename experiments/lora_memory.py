r"""The memory estimator's per-device totals of full fine-tuning vs LoRA for the Qwen3 presets.

  python -m experiments.lora_memory [--gb=80] [--rank=16]

One device, one RL step of 8 prompts x 8 completions (1024-token prompts + 1024 new tokens),
micro-batches of 4 sequences, remat=full, chunked attention, logprob_chunk=8192, BF16 compute, a
reference copy. Full fine-tuning: FP32 master weights + FP32 Adam, or BF16 master weights; LoRA
(lowrl.models.lora, rank --rank on every block linear): the frozen base in BF16 or FP32, the
adapters' gradients and Adam moments alone (memory.estimate's adapter_params). The 4-bit packed
base in the trainer (QeRL's 0.56 bytes/param) is not implemented, so it is not a row here.
Arithmetic only: nothing is allocated; prints one table.
"""
import dataclasses

from absl import app, flags

from lowrl import memory
from lowrl.models import lora
from lowrl.models.config import preset

_GB = flags.DEFINE_float("gb", 80.0, "device memory the totals are compared with (GB).")
_RANK = flags.DEFINE_integer("rank", 16, "LoRA rank.")
PRESETS = ("qwen3_0_6b", "qwen3_1_7b", "qwen3_8b")


def totals(name: str, rank: int) -> dict[str, float]:
  cfg = dataclasses.replace(preset(name), remat="full", attention="chunked",
                            logprob_chunk=8192, max_seq_len=4096)
  common = dict(batch=64, micro_batch=4, seq_len=2048, max_new_tokens=1024,
                compute_dtype="bfloat16", kv_cache_dtype="bfloat16", sampler_batch=64)
  n_adapters = lora.num_params(lora.LoraConfig(rank=rank, alpha=2.0 * rank), cfg)
  rows = {"full_fp32": dict(param_dtype="float32", reference_dtype="float32"),
          "full_bf16": dict(param_dtype="bfloat16", reference_dtype="bfloat16"),
          "lora_fp32_base": dict(param_dtype="float32", reference_dtype="float32",
                                 adapter_params=n_adapters),
          "lora_bf16_base": dict(param_dtype="bfloat16", reference_dtype="bfloat16",
                                 adapter_params=n_adapters)}
  return {k: memory.estimate(cfg, **common, **kw).total / memory.GB for k, kw in rows.items()}


def main(_):
  names = list(totals(PRESETS[0], _RANK.value))
  print(f"{'preset':<14}" + "".join(f"{n:>16}" for n in names) + "   (GB per device)")
  for p in PRESETS:
    t = totals(p, _RANK.value)
    print(f"{p:<14}" + "".join(f"{t[n]:>14.1f}{'*' if t[n] <= _GB.value else ' ':>2}"
                               for n in names))
  print(f"* fits {_GB.value:.0f} GB by the estimate")


if __name__ == "__main__":
  app.run(main)
