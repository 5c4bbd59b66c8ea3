r"""The memory estimator's per-device totals of full fine-tuning vs LoRA for Qwen3 shapes.

  python -m experiments.lora_memory [--gb=80] [--rank=16]

One device, one RL step of 8 prompts x 8 completions (1024-token prompts + 1024 new tokens),
micro-batches of 4 sequences, remat=full, chunked attention, logprob_chunk=8192, BF16 compute, a
reference copy. Full fine-tuning: FP32 master weights + FP32 Adam, or BF16 master weights; LoRA
(lowrl.models.lora, rank --rank on every block linear): the frozen base in FP32 or BF16, or
held packed under the main job's NVFP4 recipe (--config.lora.packed_base: the quantized block
linears as E2M1 codes + E4M3 block scales + FP32 outer scales, the recipe's BF16 suffix layers,
the embedding, head and norms in BF16), the adapters' gradients and Adam moments alone
(memory.estimate's adapter_params, packed_base_bytes). The Qwen3 shapes are the presets (0.6B, 1.7B, 8B) and, for the sizes between
and above, the dense shapes of the Qwen3 config.json files (4B, 14B, 32B), defined here.
Arithmetic only: nothing is allocated; prints one table and the largest shape each column fits.
"""
import dataclasses

from absl import app, flags

from lowrl import memory, precision
from lowrl.models import layout, lora
from lowrl.models.config import preset
from lowrl.training import lora_update

_GB = flags.DEFINE_float("gb", 80.0, "device memory the totals are compared with (GB).")
_RANK = flags.DEFINE_integer("rank", 16, "LoRA rank.")

# Qwen/Qwen3-{4B,14B,32B} config.json: hidden_size, intermediate_size, layers, heads / kv heads
# (head_dim 128); 4B ties its embeddings, 14B and 32B do not.
_EXTRA = {"qwen3_4b": dict(d_model=2560, d_ff=9728, n_layers=36, n_heads=32, n_kv_heads=8,
                           tie_embeddings=True),
          "qwen3_14b": dict(d_model=5120, d_ff=17408, n_layers=40, n_heads=40, n_kv_heads=8,
                            tie_embeddings=False),
          "qwen3_32b": dict(d_model=5120, d_ff=25600, n_layers=64, n_heads=64, n_kv_heads=8,
                            tie_embeddings=False)}
SHAPES = ("qwen3_0_6b", "qwen3_1_7b", "qwen3_4b", "qwen3_8b", "qwen3_14b", "qwen3_32b")


def shape(name: str):
  base = preset("qwen3_8b", **_EXTRA[name]) if name in _EXTRA else preset(name)
  return dataclasses.replace(base, remat="full", attention="chunked", logprob_chunk=8192,
                             max_seq_len=4096)


def nvfp4_bytes(cfg) -> float:
  """Bytes per parameter of the block linears under the main job's NVFP4 recipe held packed:
  E2M1 codes + E4M3 block scales + FP32 outer scales of the kernels it quantizes, its BF16
  suffix layers in BF16 (lora_update.packed_base_bytes, from the packed tree's shapes)."""
  policy = precision.policy_for("nvfp4_recipe", layout.matmuls(cfg))
  return lora_update.packed_base_bytes(cfg, policy, "bfloat16")


def totals(name: str, rank: int) -> dict[str, float]:
  cfg = shape(name)
  common = dict(batch=64, micro_batch=4, seq_len=2048, max_new_tokens=1024,
                compute_dtype="bfloat16", kv_cache_dtype="bfloat16", sampler_batch=64)
  n_adapters = lora.num_params(lora.LoraConfig(rank=rank, alpha=2.0 * rank), cfg)
  bf16 = dict(param_dtype="bfloat16", reference_dtype="bfloat16")
  rows = {"full_fp32": dict(param_dtype="float32", reference_dtype="float32"),
          "full_bf16": bf16,
          "lora_fp32_base": dict(param_dtype="float32", reference_dtype="float32",
                                 adapter_params=n_adapters),
          "lora_bf16_base": dict(bf16, adapter_params=n_adapters),
          "lora_nvfp4_base": dict(bf16, adapter_params=n_adapters,
                                  packed_base_bytes=nvfp4_bytes(cfg))}
  return {k: memory.estimate(cfg, **common, **kw).total / memory.GB for k, kw in rows.items()}


def main(_):
  names = list(totals(SHAPES[0], _RANK.value))
  print(f"{'shape':<14}" + "".join(f"{n:>17}" for n in names) + "   (GB per device)")
  fits = {n: None for n in names}
  for p in SHAPES:
    t = totals(p, _RANK.value)
    print(f"{p:<14}" + "".join(f"{t[n]:>15.1f}{'*' if t[n] <= _GB.value else ' ':>2}"
                               for n in names))
    fits.update({n: p for n in names if t[n] <= _GB.value})
  print(f"* fits {_GB.value:.0f} GB by the estimate; largest that fits: "
        + ", ".join(f"{n} {fits[n]}" for n in names))


if __name__ == "__main__":
  app.run(main)
