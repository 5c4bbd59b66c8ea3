r"""Per-device memory, FLOPs per RL step and expected step time of a model on a device slice,
from `lowrl.memory` (no compile, no devices needed).

  python -m experiments.estimate_memory --model=qwen3_8b --hardware=h100_sxm --devices=8
  python -m experiments.estimate_memory --model=qwen3_8b --hardware=v5p --devices=64 \
      --remat=full --attention=chunked --logprob_chunk=8192
  python -m experiments.estimate_memory --model=qwen3_30b_a3b --hardware=b200 --devices=8 \
      --expert_parallel=8 --remat=full --attention=chunked --logprob_chunk=8192

Prints the table of `lowrl.memory.format_estimate` (per-device bytes of every term, FLOPs of
every phase, step time at --mfu) and whether it fits in --headroom of one device's HBM; exits
with status 1 when it does not, after naming the knobs to change. docs/scaling.md lists the
numbers of the reference configurations.
"""
from __future__ import annotations

from absl import app, flags

from lowrl import hardware as hardware_lib
from lowrl import memory
from lowrl.models import config as model_config

_MODEL = flags.DEFINE_enum("model", "qwen3_8b", model_config.preset_names(), "Model preset.")
_HARDWARE = flags.DEFINE_enum("hardware", "h100_sxm", sorted(hardware_lib.HARDWARE),
                              "Accelerator (lowrl.hardware.HARDWARE).")
_DEVICES = flags.DEFINE_integer("devices", 8, "Devices in the slice (data x model).")
_MODEL_PARALLEL = flags.DEFINE_integer("model_parallel", 1,
                                       "Devices on the mesh's model axis; divides --devices.")
_EXPERT_PARALLEL = flags.DEFINE_integer("expert_parallel", 1,
                                        "MoE: devices on the mesh's expert axis (expert "
                                        "parallel; divides the data devices).")
_BATCH = flags.DEFINE_integer("batch", 256, "Sequences per optimizer step (prompts x group).")
_SAMPLER_BATCH = flags.DEFINE_integer("sampler_batch", 0,
                                      "Rows the sampler decodes at once; 0 = --batch.")
_MICRO_BATCH = flags.DEFINE_integer("micro_batch", 8, "Sequences per forward/backward.")
_SEQ_LEN = flags.DEFINE_integer("seq_len", 4096, "Prompt + completion tokens per sequence.")
_MAX_NEW = flags.DEFINE_integer("max_new_tokens", 3584, "Completion tokens per sequence.")
# The model's execution knobs (lowrl.models.config.ModelConfig, --config.model.* in training).
_REMAT = flags.DEFINE_enum("remat", "none", model_config.REMAT_MODES,
                           "Per-layer remat (ModelConfig.remat).")
_ATTENTION = flags.DEFINE_enum("attention", "materialized", model_config.ATTENTION_MODES,
                               "materialized: FP32 [B, H, T, T] scores; chunked: "
                               "--attention_chunk query rows at a time.")
_ATTENTION_CHUNK = flags.DEFINE_integer("attention_chunk", 512,
                                        "Query rows per chunk of --attention=chunked.")
_CHUNK = flags.DEFINE_integer("logprob_chunk", 0,
                              "Vocabulary chunk of the logprobs; 0 = full [B, T, V] FP32.")
_PARAM_DTYPE = flags.DEFINE_enum("param_dtype", "float32", sorted(memory.DTYPE_BYTES),
                                 "Master weights (the param tree) and gradients.")
_REFERENCE = flags.DEFINE_enum("reference_dtype", "float32",
                               ["none"] + sorted(memory.DTYPE_BYTES),
                               "Reference params' dtype; none = no reference.")
_ASYNC = flags.DEFINE_integer("async_versions", 0, "Older param versions kept (async RL).")
_ASYNC_DTYPE = flags.DEFINE_enum("async_dtype", "float32", sorted(memory.DTYPE_BYTES),
                                 "Dtype of the async versions.")
_KV_DTYPE = flags.DEFINE_enum("kv_cache_dtype", "bfloat16", sorted(memory.DTYPE_BYTES),
                              "KV cache dtype.")
_EPOCHS = flags.DEFINE_integer("ppo_epochs", 1, "Optimizer passes over each batch.")
_MFU = flags.DEFINE_float("mfu", 0.4, "Model FLOPs utilisation assumed for the step time.")
_HEADROOM = flags.DEFINE_float("headroom", 0.9, "Fraction of HBM the estimate may use.")


def run(*, model: str, hardware: str, devices: int, model_parallel: int, batch: int,
        expert_parallel: int = 1,
        sampler_batch: int, micro_batch: int, seq_len: int, max_new_tokens: int, remat: str,
        attention: str, attention_chunk: int, logprob_chunk: int, param_dtype: str, reference_dtype: str,
        async_versions: int, async_dtype: str, kv_cache_dtype: str, ppo_epochs: int, mfu: float,
        headroom: float) -> tuple[str, bool]:
  """(the printed report, whether it fits), from the flags' values (their help says each)."""
  hw = hardware_lib.hardware(hardware)
  if devices < 1 or model_parallel < 1 or devices % model_parallel:
    raise ValueError(f"--model_parallel={model_parallel} must divide --devices={devices} (both "
                     ">= 1).")
  model_cfg = model_config.preset(model, remat=remat, attention=attention,
                                  attention_chunk=attention_chunk, logprob_chunk=logprob_chunk)
  est = memory.estimate(
      model_cfg, batch=batch, micro_batch=micro_batch, seq_len=seq_len,
      max_new_tokens=max_new_tokens, mesh=(devices // model_parallel, model_parallel),
      param_dtype=param_dtype, keep_reference=reference_dtype != "none",
      reference_dtype="float32" if reference_dtype == "none" else reference_dtype,
      async_versions=async_versions, async_dtype=async_dtype, kv_cache_dtype=kv_cache_dtype,
      ppo_epochs=ppo_epochs, sampler_batch=sampler_batch or None,
      expert_parallel=expert_parallel)
  lines = [f"{model} on {devices} x {hw.name}", memory.format_estimate(est, hw, mfu), ""]
  try:
    memory.check_fits(est, hw.hbm_bytes, headroom)
    lines.append(f"fits in {headroom:g} x {hw.hbm_gb:g} GB per device.")
    return "\n".join(lines), True
  except ValueError as e:
    lines.append(f"DOES NOT FIT: {e}")
    return "\n".join(lines), False


def main(argv):
  del argv
  text, fits = run(model=_MODEL.value, hardware=_HARDWARE.value, devices=_DEVICES.value,
                   model_parallel=_MODEL_PARALLEL.value, batch=_BATCH.value,
                   expert_parallel=_EXPERT_PARALLEL.value,
                   sampler_batch=_SAMPLER_BATCH.value,
                   micro_batch=_MICRO_BATCH.value, seq_len=_SEQ_LEN.value,
                   max_new_tokens=_MAX_NEW.value, remat=_REMAT.value,
                   attention=_ATTENTION.value, attention_chunk=_ATTENTION_CHUNK.value,
                   logprob_chunk=_CHUNK.value,
                   param_dtype=_PARAM_DTYPE.value, reference_dtype=_REFERENCE.value,
                   async_versions=_ASYNC.value, async_dtype=_ASYNC_DTYPE.value,
                   kv_cache_dtype=_KV_DTYPE.value, ppo_epochs=_EPOCHS.value, mfu=_MFU.value,
                   headroom=_HEADROOM.value)
  print(text)
  return 0 if fits else 1


if __name__ == "__main__":
  app.run(main)
