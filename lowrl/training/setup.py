"""`build`: a run's config -> its typed, frozen pieces, validated once before anything compiles.

`build` is the only reader of the raw `ConfigDict` on the way to training: the Trainer, the state
tree, the step loop and its logging take the `Setup` it returns (typed configs: the task, model,
precision policies, sampling, update, schedule, mesh, the loop's own knobs `LoopConfig`, the
base's `BaseConfig`, and `ConfigRecord`: what the logs show of the config). Every config error
is raised here as a one-line ValueError naming the flag and the fix.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any

import ml_collections
import numpy as np
import optax

from lowrl import hardware, memory, precision, quant_blocks, sharding
from lowrl.checkpoints import hf, hf_config
from lowrl.checkpoints.tokenizer import MissingEosError, Tokenizer, load_tokenizer
from lowrl.models import init, kv_cache, layout, routing
from lowrl.models import lora as lora_lib
from lowrl.models.config import ModelConfig
from lowrl.sampling import SamplingConfig
from lowrl.tasks.base import Task
from lowrl.tasks.registry import make_task
from lowrl.training import aqn as aqn_lib
from lowrl.training import compute_cast, lora_update, optimizer, run_config, schema, sft
from lowrl.training.base_store import BaseConfig
from lowrl.training.knobs import as_flags
from lowrl.training.rl_update import UpdateConfig, update_config_from
from lowrl.training.schedule import AsyncSchedule
from lowrl.training.step import BatchConfig


def keep_steps(fractions, steps: int) -> tuple[int, ...]:
  """The steps of `checkpoint_keep_fractions` in a run of `steps`: round(f x steps) half up, at
  least 1, sorted, distinct."""
  return tuple(sorted({max(1, math.floor(f * steps + 0.5)) for f in fractions}))


@dataclasses.dataclass(frozen=True)
class LoopConfig:
  """The host loop's own knobs (lowrl.training.schema.TRAIN has their meanings)."""

  seed: int
  steps: int  # rl.steps
  num_prompts: int  # rl.num_prompts
  group_size: int  # rl.group_size
  eval_num_prompts: int
  eval_samples: int
  eval_every: int
  log_every: int
  checkpoint_every: int
  keep_steps: tuple[int, ...]  # checkpoint_keep_fractions as steps (`keep_steps`): never rotated
  num_text_samples: int
  max_skipped_steps: int
  precompile: bool  # the RL update compiled on a background thread (lowrl.training.precompile)
  diagnostics_every: int  # diagnostics.every
  code_churn: bool  # diagnostics.code_churn
  refit_check_every: int
  sampler_exact: bool
  sampler_decode_min_rows: int
  sampler_decode_buckets_per_halving: int
  routing_replay: bool  # rl.routing_replay (MoE)
  keep_reference: bool  # rl.kl_coef > 0 or rl.log_kl_ref: the run holds reference params
  ref_storage: str  # rl.ref_storage
  ref_reset_every: int  # rl.ref_reset_every
  version_storage: str  # async_rl.version_storage
  master_dtype: str  # optimizer.master_dtype
  master_rounding: str  # optimizer.master_rounding
  loss_scale: float  # optimizer.loss_scale
  task_name: str  # task.name (for the logs)
  updates_per_step: int  # rl.mu x rl.num_minibatches optimizer updates per RL step

  @property
  def batch_size(self) -> int:
    """Rollout rows per step: num_prompts x group_size."""
    return self.num_prompts * self.group_size

  @classmethod
  def from_config(cls, cfg: ml_collections.ConfigDict) -> LoopConfig:
    rl = cfg.rl
    return cls(seed=cfg.seed, steps=rl.steps, num_prompts=rl.num_prompts,
               group_size=rl.group_size, eval_num_prompts=cfg.eval_num_prompts,
               eval_samples=cfg.eval_samples, eval_every=cfg.eval_every,
               log_every=cfg.log_every, checkpoint_every=cfg.checkpoint_every,
               keep_steps=keep_steps(cfg.checkpoint_keep_fractions, rl.steps),
               num_text_samples=cfg.num_text_samples, max_skipped_steps=cfg.max_skipped_steps,
               precompile=bool(cfg.precompile),
               diagnostics_every=cfg.diagnostics.every,
               code_churn=bool(cfg.diagnostics.code_churn),
               refit_check_every=cfg.refit_check_every, sampler_exact=bool(cfg.sampler_exact),
               sampler_decode_min_rows=cfg.sampler_decode_min_rows,
               sampler_decode_buckets_per_halving=cfg.sampler_decode_buckets_per_halving,
               routing_replay=bool(rl.routing_replay),
               keep_reference=bool(rl.kl_coef > 0 or rl.log_kl_ref),
               ref_storage=rl.ref_storage, ref_reset_every=rl.ref_reset_every,
               version_storage=cfg.async_rl.version_storage,
               master_dtype=cfg.optimizer.master_dtype,
               master_rounding=cfg.optimizer.master_rounding,
               loss_scale=cfg.optimizer.loss_scale, task_name=cfg.task.name,
               updates_per_step=rl.mu * rl.num_minibatches)


@dataclasses.dataclass(frozen=True)
class ConfigRecord:
  """What the logs show of the resolved config (lowrl.training.run_config of it)."""

  fingerprint: str  # run_config.fingerprint: checkpoints and summary.json record it
  text: str  # run_config.describe: every knob, one a line
  hparams: dict[str, Any]  # run_config.flatten: TensorBoard's hparams


@dataclasses.dataclass(frozen=True)
class Setup:
  """Everything static a run needs, validated (no raw config: `build` read it)."""

  loop: LoopConfig
  base: BaseConfig
  record: ConfigRecord
  task: Task
  model_cfg: ModelConfig
  trainer_policy: precision.PrecisionPolicy
  sampler_policy: precision.PrecisionPolicy
  sampling: SamplingConfig
  eval_sampling: SamplingConfig
  update_cfg: UpdateConfig
  batch_cfg: BatchConfig  # rollout -> batch of the RL step
  tx: optax.GradientTransformation  # the RL optimizer (its schedule spans the run's steps)
  schedule: AsyncSchedule
  plan: sharding.ShardingPlan
  memory: memory.MemoryEstimate  # per-device estimate
  hardware: str  # the `hardware` knob
  device_memory: tuple[float | None, str] = (None, "")  # memory.device_memory(hardware)
  lr_schedule: Any = None  # the optimizer's learning-rate schedule (optax.Schedule), per update
  lora: lora_lib.LoraConfig | None = None  # LoRA adapters on a frozen base; None = full FT
  aqn: aqn_lib.AqnConfig | None = None  # QeRL's noise in the base's RMSNorms; None = off

  @property
  def batch_size(self) -> int:
    return self.loop.batch_size


def build(cfg: ml_collections.ConfigDict) -> Setup:
  """Validates the config (lowrl.training.schema.TRAIN, then the types built from it) and builds
  the static pieces; raises ValueError naming the flag and the fix, before any compile."""
  rl = cfg.rl
  schema.TRAIN.validate(cfg)
  _check_checkpoint_flags(cfg)
  task = _make_task(cfg.task, cfg.model.hf_checkpoint, cfg.model.eos_token)
  max_len = task.max_prompt_len + max(rl.max_new_tokens, task.max_answer_len)
  model_cfg = _model_config(cfg.model, task, max_len)
  if rl.routing_replay:
    try:
      routing.check_replay(model_cfg)
    except ValueError as e:
      raise ValueError(f"--config.rl.routing_replay: {e}") from None
  matmuls = layout.matmuls(model_cfg)
  lora_cfg = lora_lib.config_from(cfg.lora)
  if lora_cfg is not None:
    lora_lib.check(lora_cfg, model_cfg)
    lora_update.check_config(cfg)
  try:  # lowrl.precision names its knobs `precision.x`; the flag is --config.precision.x
    trainer_policy = precision.make_policy(cfg.precision, matmuls)
  except ValueError as e:
    raise ValueError(as_flags(str(e), "precision")) from None
  sampler_cfg = cfg.precision
  if cfg.sampler_precision.recipe:
    sampler_cfg = precision.recipe(cfg.sampler_precision.recipe)
  kv_cache.check_mode(cfg.sampler_precision.kv_cache, model_cfg.head_dim)
  sampler_policy = dataclasses.replace(precision.make_policy(sampler_cfg, matmuls),
                                       kv_cache=cfg.sampler_precision.kv_cache)
  # Both sides add the adapters with the same precision (exact mode: one forward).
  trainer_policy = lora_lib.adapter_policy(trainer_policy, lora_cfg)
  sampler_policy = lora_lib.adapter_policy(sampler_policy, lora_cfg)
  if cfg.lora.get("packed_base", False):
    lora_update.check_packed_base(cfg, lora_cfg, model_cfg, trainer_policy)
  aqn_cfg = aqn_lib.config_from(cfg.lora)
  if aqn_cfg is not None:
    if lora_cfg is None:
      raise ValueError("--config.lora.aqn_sigma_start perturbs a frozen LoRA base's RMSNorms, "
                       "but lora.rank=0 trains them; set --config.lora.rank > 0 or "
                       "aqn_sigma_start=0.")
    aqn_lib.check(aqn_cfg)
  stop = task.tokenizer.eos_ids  # every eos of a checkpoint ends a completion
  sampling = SamplingConfig(max_new_tokens=rl.max_new_tokens, temperature=rl.temperature,
                            top_k=rl.top_k, top_p=rl.top_p, stop_tokens=stop,
                            pad_id=task.tokenizer.pad_id)
  sampling.check(model_cfg)
  eval_sampling = dataclasses.replace(sampling, temperature=0.0, top_k=0, top_p=1.0)
  update_cfg = update_config_from(rl, cfg.optimizer.master_rounding, max_len=rl.max_new_tokens)
  compute_cast.check(cfg.optimizer.compute_cast_rounding, cfg.optimizer.master_dtype,
                     cfg.precision)
  if cfg.optimizer.compute_cast_rounding == "stochastic":
    update_cfg = dataclasses.replace(
        update_cfg, compute_cast=compute_cast.cast_paths(model_cfg, trainer_policy))
  a = cfg.async_rl
  schedule = AsyncSchedule(lag=a.lag, sync_every=a.sync_every,
                           lag_distribution=a.lag_distribution, seed=cfg.seed)
  loop = LoopConfig.from_config(cfg)
  seq_len = task.max_prompt_len + rl.max_new_tokens
  if 0 < rl.pack_tokens < seq_len:
    raise ValueError(f"--config.rl.pack_tokens={rl.pack_tokens} is smaller than the longest "
                     f"sequence (prompt width {task.max_prompt_len} + rl.max_new_tokens "
                     f"{rl.max_new_tokens} = {seq_len}); raise it to >= {seq_len}, or 0 (off).")
  plan = _mesh_plan(cfg, model_cfg, trainer_policy, sampler_policy, seq_len=seq_len)
  est = memory_estimate(cfg, model_cfg, trainer_policy, sampler_policy, plan, schedule, seq_len,
                        keep_reference=loop.keep_reference,
                        adapter_params=0 if lora_cfg is None else lora_lib.num_params(lora_cfg,
                                                                                      model_cfg),
                        packed_base_bytes=lora_update.packed_base_bytes(
                            model_cfg, trainer_policy, cfg.optimizer.master_dtype)
                        if lora_cfg is not None and lora_cfg.packed_base else 0.0)
  budget = memory.device_memory(cfg.hardware)
  if budget[0] is not None:
    try:
      memory.check_fits(est, budget[0], hints=MEMORY_HINTS,
                        what="host RAM" if budget[1].startswith(("host", "cgroup")) else "HBM")
    except ValueError as e:
      raise ValueError(f"--config.hardware={cfg.hardware} ({budget[1]}): {e}") from None
  seed = cfg.sft.seed if cfg.sft.seed >= 0 else cfg.seed
  base = BaseConfig(hf_checkpoint=cfg.model.hf_checkpoint, param_dtype=cfg.model.param_dtype,
                    base_dir=cfg.sft.base_dir,
                    sft=sft.SFTConfig(steps=cfg.sft.steps, batch_size=cfg.sft.batch_size,
                                      lr=cfg.sft.lr, warmup_steps=cfg.sft.warmup_steps),
                    seed=seed, fingerprint=sft.fingerprint(cfg.task, model_cfg, cfg.sft, seed),
                    outliers=(int(cfg.sft.outlier_channels), float(cfg.sft.outlier_gain)))
  record = ConfigRecord(run_config.fingerprint(cfg), run_config.describe(cfg),
                        run_config.flatten(cfg))
  updates = rl.steps * rl.mu * rl.num_minibatches
  tx = optimizer.make_optimizer(cfg.optimizer, updates)
  return Setup(loop, base, record, task, model_cfg, trainer_policy, sampler_policy, sampling,
               eval_sampling, update_cfg, BatchConfig.from_rl(rl, rl.max_new_tokens), tx,
               schedule, plan, est, cfg.hardware, budget,
               lr_schedule=optimizer.make_schedule(cfg.optimizer, updates), lora=lora_cfg,
               aqn=aqn_cfg)


# The loop's flags that shrink each term of the estimate (memory.KNOB_HINTS's keys).
MEMORY_HINTS = {
    "blocks": "--config.model.remat=full, or more --config.rl.micro_batches",
    "scores": "--config.model.attention=chunked, or more --config.rl.micro_batches",
    "logits": "--config.model.logprob_chunk=8192, or more --config.rl.micro_batches",
    "params": "--config.optimizer.master_dtype=bfloat16 or more devices",
    "grads": "--config.optimizer.master_dtype=bfloat16 or more devices",
    "optimizer": "more devices (--config.mesh.shape)",
    "reference": "--config.rl.ref_storage=bfloat16, or --config.rl.log_kl_ref=False with "
                 "--config.rl.kl_coef=0, or more devices",
    "versions": "--config.async_rl.version_storage=bfloat16, a smaller --config.async_rl.lag, "
                "or more devices",
    "kv_cache": "fewer --config.rl.num_prompts x group_size rows, or a 2-byte "
                "precision.compute_dtype",
    "prefill": "--config.model.attention=chunked",
    "devices": "more devices (--config.mesh.shape)",
}


def memory_estimate(cfg: ml_collections.ConfigDict, model_cfg: ModelConfig,
                    trainer_policy: precision.PrecisionPolicy,
                    sampler_policy: precision.PrecisionPolicy, plan: sharding.ShardingPlan,
                    schedule: AsyncSchedule, seq_len: int, *,
                    keep_reference: bool, adapter_params: int = 0,
                    packed_base_bytes: float = 0.0) -> memory.MemoryEstimate:
  """The per-device memory estimate of one RL step of this run (lowrl.memory.estimate).

  What the loop holds: FP32 Adam moments over the master params (optimizer.master_dtype), the
  reference params when `keep_reference` (LoopConfig.keep_reference), the schedule's parameter
  copies, the RL sampler's KV cache (all rows, the sampler policy's compute dtype; the eval
  samplers' caches are left out, as in lowrl.memory); each PPO minibatch is one optimizer step
  over `rl.micro_batches` forward/backward passes, or with `rl.pack_tokens` over packed
  micro-batches of `rl.pack_rows` rows of `rl.pack_tokens` per data shard (their activations
  sized as such a micro-batch). `adapter_params`: a LoRA run's adapters
  (the gradients and Adam moments then cover them alone; memory.estimate); `packed_base_bytes`:
  its base's block linears held packed (lora.packed_base).
  """
  rl = cfg.rl
  rows = rl.num_prompts * rl.group_size
  data = plan.batch_shards
  stale = schedule.stale  # versions copied, stale ones re-scored
  master = cfg.optimizer.master_dtype
  # A host-stored copy is moved to the devices for the step that reads it: counted at full size.
  def stored(storage: str) -> str:
    return "bfloat16" if storage == "bfloat16" else master

  return memory.estimate(
      model_cfg, batch=rows, micro_batch=rows // rl.num_minibatches // rl.micro_batches,
      seq_len=seq_len,
      max_new_tokens=rl.max_new_tokens, mesh=(data, plan.mesh.size // data),
      param_dtype=master, optimizer_dtype="float32", compute_dtype=trainer_policy.compute_dtype,
      keep_reference=keep_reference, reference_dtype=stored(rl.ref_storage),
      async_versions=schedule.max_versions if stale else 0,
      async_dtype=stored(cfg.async_rl.version_storage),
      kv_cache_dtype=sampler_policy.compute_dtype, sampler_batch=rows, ppo_epochs=rl.mu,
      score_forwards=2 if stale else 1, minibatches=rl.num_minibatches,
      expert_parallel=_expert_parallel(model_cfg, plan), adapter_params=adapter_params,
      packed_base_bytes=packed_base_bytes,
      packed_micro_batch=_update_micro_batch(rl, data, seq_len) if rl.pack_tokens else None)


def _update_micro_batch(rl: ml_collections.ConfigDict, shards: int, seq_len: int
                        ) -> tuple[int, int]:
  """(rows, columns) of one forward/backward of the update: a minibatch / rl.micro_batches of
  padded rows, or with rl.pack_tokens rl.pack_rows packed rows of rl.pack_tokens per data shard
  (at most the minibatch's rows: `packing.PackConfig.layout`)."""
  minibatch = rl.num_prompts * rl.group_size // rl.num_minibatches
  if not rl.pack_tokens:
    return minibatch // rl.micro_batches, seq_len
  return min(rl.pack_rows * shards, minibatch), rl.pack_tokens


def _expert_parallel(model_cfg: ModelConfig, plan: sharding.ShardingPlan) -> int:
  """Devices of the mesh's expert axis, where the routed experts are split over it."""
  e = dict(plan.mesh.shape).get(sharding.EXPERT, 1)
  return e if model_cfg.is_moe and plan.batch_shards % e == 0 else 1


def describe_memory(setup: Setup) -> str:
  """The setup's per-device memory estimate (and the budget it was checked against), as text."""
  hw = hardware.HARDWARE.get(setup.hardware)
  budget, source = setup.device_memory
  fit = ("not checked" if budget is None else
         f"{setup.memory.total / budget:.0%} of {budget / memory.GB:.1f} GB")
  return (f"[memory] per-device estimate before compiling ({fit}; {source}):\n"
          + memory.format_estimate(setup.memory, hw))


def _check_checkpoint_flags(cfg: ml_collections.ConfigDict) -> None:
  """The flags a real checkpoint needs, and those that need one (one-line errors)."""
  source = cfg.model.hf_checkpoint
  if cfg.task.chat_template and not source:
    raise ValueError("--config.task.chat_template=True renders prompts with a checkpoint's chat "
                     "template; set --config.model.hf_checkpoint=DIR too (or drop it).")
  if not source:
    return
  if cfg.task.name != "jsonl":
    raise ValueError(f"--config.model.hf_checkpoint needs a task in the checkpoint's tokenizer: "
                     f"--config.task.name=jsonl --config.task.path=FILE (task {cfg.task.name!r} "
                     "uses lowrl's character tokenizer).")
  if cfg.sft.steps:
    raise ValueError(f"--config.sft.steps={cfg.sft.steps}: mid-training starts from a random "
                     "init; with --config.model.hf_checkpoint set --config.sft.steps=0 (RL starts "
                     "from the checkpoint).")


def _make_task(task_cfg: ml_collections.ConfigDict, hf_checkpoint: str = "",
               eos_token: str = "") -> Task:
  """The task of a validated `config.task`, with both splits checked non-empty (before any SFT
  or compile). With a checkpoint, prompts are tokenized by its tokenizer (`eos_token`: the one
  token that ends a completion, '' = those its files name), and rendered with its chat template
  when `task_cfg.chat_template`."""
  kwargs = task_cfg.kwargs.to_dict()
  if task_cfg.name == "jsonl":
    kwargs.setdefault("path", task_cfg.path)
    kwargs.setdefault("verifier", task_cfg.verifier or "exact")
  if hf_checkpoint:
    if task_cfg.chat_template:
      kwargs.setdefault("chat_template", hf_checkpoint)
  try:
    if hf_checkpoint and "tokenizer" not in kwargs:
      kwargs["tokenizer"] = _checkpoint_tokenizer(hf_checkpoint, eos_token)
    task = make_task(task_cfg.name, **kwargs)
    for split in ("train", "eval"):
      task.sample(np.random.default_rng(0), 1, split)  # an empty split raises, naming the fix
  except (OSError, ValueError) as e:
    # The flag whose file the error is about: the JSONL file, the chat template, the checkpoint.
    path = kwargs.get("path") if task_cfg.name == "jsonl" else None
    if str(e).startswith("--config."):
      raise
    if path and str(path) in str(e):
      flag = f"task.path={path}"
    elif hf_checkpoint and "chat_template" in str(e):
      flag = "task.chat_template"
    elif hf_checkpoint:
      flag = f"model.hf_checkpoint={hf_checkpoint}"
    else:
      raise
    raise ValueError(f"--config.{flag}: {e}") from None
  return task


def _checkpoint_tokenizer(path: str, eos_token: str) -> Tokenizer:
  """The checkpoint's tokenizer; with no eos token in its files, an error naming the flag."""
  try:
    return load_tokenizer(path, eos_token=eos_token or None)
  except MissingEosError as e:
    raise ValueError(
        f"--config.model.hf_checkpoint={path}: no eos token in {e.where}. Set "
        "--config.model.eos_token=TOKEN, the token the model ends a completion with (the "
        f"tokenizer's special tokens: {list(e.specials) or 'none'}), or add \"eos_token\": "
        f"TOKEN to {e.config_file}.") from None
  except ValueError as e:
    if eos_token and str(e).startswith("eos_token="):  # the flag's token is not in tokenizer.json
      raise ValueError(f"--config.model.{e}") from None
    raise


def _model_config(model: ml_collections.ConfigDict, task: Task, max_len: int) -> ModelConfig:
  """The decoder of `config.model`: the tiny architecture of its knobs (vocabulary: the task's
  tokenizer), or a checkpoint's config.json (weights checked from the file headers) with the
  section's execution knobs."""
  knobs = model.to_dict()
  source = knobs.pop("hf_checkpoint")
  knobs.pop("param_dtype")
  knobs.pop("eos_token")
  scan = knobs.pop("scan_layers")
  if not source:
    try:
      return ModelConfig(vocab_size=task.tokenizer.vocab_size, max_seq_len=max_len,
                         scan_layers=bool(scan), **knobs)
    except ValueError as e:  # ModelConfig names its fields, which are the section's knobs
      text = as_flags(str(e).replace("ModelConfig.", "", 1), "model", model.keys())
      raise ValueError(text if text.startswith("--config.") else f"--config.model: {text}"
                       ) from None
  execution = {k: knobs[k] for k in ("remat", "attention", "attention_chunk", "logprob_chunk")}
  try:
    hf_cfg = hf.read_checkpoint_config(source)  # a directory's config.json or a .gguf's metadata
    model_cfg = dataclasses.replace(hf_config.model_config_from_hf(hf_cfg),
                                    scan_layers=True if scan is None else bool(scan), **execution)
    hf.check_hf_weights(source, model_cfg)
  except (OSError, ValueError) as e:
    raise ValueError(f"--config.model.hf_checkpoint={source}: {e}") from None
  if task.tokenizer.vocab_size > model_cfg.vocab_size:
    raise ValueError(f"--config.model.hf_checkpoint={source}: tokenizer.json has "
                     f"{task.tokenizer.vocab_size} tokens but the model only "
                     f"{model_cfg.vocab_size} embedding rows; the files do not belong together.")
  if max_len > model_cfg.max_seq_len:
    raise ValueError(f"Prompts + completions need {max_len} positions but the checkpoint's "
                     f"max_position_embeddings is {model_cfg.max_seq_len}; lower "
                     "--config.rl.max_new_tokens or shorten the prompts.")
  return model_cfg


def _mesh_plan(cfg: ml_collections.ConfigDict, model_cfg: ModelConfig,
               trainer_policy: precision.PrecisionPolicy,
               sampler_policy: precision.PrecisionPolicy, seq_len: int) -> sharding.ShardingPlan:
  """The mesh and rules of `cfg.mesh`, checked against the batch sizes and quantizer blocks."""
  plan = sharding.plan_from_config(cfg.mesh)
  rows = cfg.rl.num_prompts * cfg.rl.group_size
  plan.check_batch(rows, "rl.num_prompts * rl.group_size")
  plan.check_batch(rows // cfg.rl.num_minibatches,
                   "a minibatch (rl.num_prompts * rl.group_size / rl.num_minibatches)")
  plan.check_batch(rows // cfg.rl.num_minibatches // cfg.rl.micro_batches,
                   "a micro-batch (a minibatch / rl.micro_batches)")
  plan.check_batch(cfg.eval_num_prompts, "eval_num_prompts")
  plan.param_specs(init.param_shapes(model_cfg))  # rule/shape mismatches raise here
  micro = _update_micro_batch(cfg.rl, plan.batch_shards, seq_len)
  for what, policy in (("precision", trainer_policy), ("sampler precision", sampler_policy)):
    quant_blocks.check_quant_blocks(policy, model_cfg, plan, seq_len=micro[1], what=what,
                                    rows=micro[0])
  return plan
