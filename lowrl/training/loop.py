"""The RL training loop: mid-trained base (or a Hugging Face checkpoint) -> GRPO-family updates
under a precision recipe.

Everything static is built and validated by `build` before anything is compiled. Each step:
  1. the sampler generates a group of completions per prompt with the policy *version* and
     precision the asynchronous schedule says (version = current params when synchronous);
  2. the host decodes completions and scores them with the task's verifier;
  3. the trainer scores the sampled tokens (pi_old; and with the sampler's weights when they are
     stale) with the sampler's jitted exact-mode scoring program (`lowrl.sampling.rescore`),
     unless the exact-mode sampler already ran that program on the same inputs
     (`Trainer.sampler_scored_pi_old`);
  4. the jitted RL step (`lowrl.training.step`, shared with the simulator) builds the batch
     (overlong penalty, group advantages, dynamic sampling), the drift decomposition, and runs
     the pure update: mismatch correction and mu optimizer passes against that pi_old;
  5. metrics (reward, mismatch, drift decomposition, entropy, clip fraction, gradient norm,
     weight quantization error, sample texts) go to TensorBoard and `metrics.jsonl`;
  6. an orbax checkpoint every `checkpoint_every` steps (params, optimizer state, reference
     params, parameter versions the schedule still needs, RNG key, step, data position).
Prompts of step t are drawn from a generator seeded by (seed, t), so the data position is the
step and a resumed run sees exactly the prompts an uninterrupted one would.
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import time
from typing import Any, Callable

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

from lowrl import distributed, hardware, memory, precision, sharding
from lowrl.checkpoints import hf
from lowrl.metrics import layout as tb_layout
from lowrl.metrics.writer import create_writer
from lowrl.models import kv_cache, layout, transformer
from lowrl.models.config import ModelConfig
from lowrl.rl.mismatch import mismatch_metrics
from lowrl.sampling import SampleOutput, Sampler, SamplingConfig, refit, rescore
from lowrl.sampling.act_scales import calibration_paths
from lowrl.tasks.base import Task
from lowrl.tasks.batching import decode_batch, encode_prompts, encode_sft
from lowrl.tasks.registry import make_task
from lowrl.training import (base_store, diagnostics, disk, optimizer, pace, preemption, probes,
                            run_config, run_logs, schema, sft, storage)
from lowrl.training.checkpointing import Checkpointer, read_meta
from lowrl.training.workdir_lock import WorkdirLock
from lowrl.training.evaluation import eval_metrics
from lowrl.training.kv_share import kv_share_metrics
from lowrl.training.loss_scaling import loss_scaled
from lowrl.training.rl_update import UpdateConfig, make_logprob_fn, update_config_from
from lowrl.training.schedule import AsyncSchedule, VersionBuffer
from lowrl.training.step import BATCH_METRICS, BatchConfig, Rollout, make_step

Log = Callable[[str], None]
_PROBE_STREAM = 0x9B0BE  # fold_in of the step key for the probes: a stream no step uses


@dataclasses.dataclass(frozen=True)
class Setup:
  """Everything static a run needs, validated."""

  cfg: ml_collections.ConfigDict
  task: Task
  model_cfg: ModelConfig
  trainer_policy: precision.PrecisionPolicy
  sampler_policy: precision.PrecisionPolicy
  sampling: SamplingConfig
  eval_sampling: SamplingConfig
  update_cfg: UpdateConfig
  schedule: AsyncSchedule
  plan: sharding.ShardingPlan | None = None  # None: one device
  batch_cfg: BatchConfig | None = None  # rollout -> batch of the RL step (set by `build`)
  memory: memory.MemoryEstimate | None = None  # per-device estimate (set by `build`)
  device_memory: tuple[float | None, str] = (None, "")  # memory.device_memory(cfg.hardware)

  @property
  def batch_size(self) -> int:
    return self.cfg.rl.num_prompts * self.cfg.rl.group_size


def build(cfg: ml_collections.ConfigDict) -> Setup:
  """Validates the config (lowrl.training.schema.TRAIN, then the types built from it) and builds
  the static pieces; raises ValueError naming the flag and the fix, before any compile."""
  rl = cfg.rl
  schema.TRAIN.validate(cfg)
  _check_checkpoint_flags(cfg)
  task = _make_task(cfg.task, cfg.model.hf_checkpoint)
  max_len = task.max_prompt_len + max(rl.max_new_tokens, task.max_answer_len)
  model_cfg = _model_config(cfg.model, task, max_len)
  matmuls = layout.matmuls(model_cfg)
  trainer_policy = precision.make_policy(cfg.precision, matmuls)
  sampler_cfg = cfg.precision
  if cfg.sampler_precision.recipe:
    sampler_cfg = precision.recipe(cfg.sampler_precision.recipe)
  kv_cache.check_mode(cfg.sampler_precision.kv_cache, model_cfg.head_dim)
  sampler_policy = dataclasses.replace(precision.make_policy(sampler_cfg, matmuls),
                                       kv_cache=cfg.sampler_precision.kv_cache)
  stop = task.tokenizer.eos_ids  # every eos of a checkpoint ends a completion
  sampling = SamplingConfig(max_new_tokens=rl.max_new_tokens, temperature=rl.temperature,
                            top_k=rl.top_k, top_p=rl.top_p, stop_tokens=stop,
                            pad_id=task.tokenizer.pad_id)
  sampling.check(model_cfg)
  eval_sampling = dataclasses.replace(sampling, temperature=0.0, top_k=0, top_p=1.0)
  update_cfg = update_config_from(rl, cfg.optimizer.master_rounding, max_len=rl.max_new_tokens)
  a = cfg.async_rl
  schedule = AsyncSchedule(lag=a.lag, sync_every=a.sync_every,
                           lag_distribution=a.lag_distribution, seed=cfg.seed)
  seq_len = task.max_prompt_len + rl.max_new_tokens
  plan = _mesh_plan(cfg, model_cfg, trainer_policy, sampler_policy, seq_len=seq_len)
  est = memory_estimate(cfg, model_cfg, trainer_policy, sampler_policy, plan, schedule, seq_len)
  budget = memory.device_memory(cfg.hardware)
  if budget[0] is not None:
    try:
      memory.check_fits(est, budget[0], hints=MEMORY_HINTS,
                        what="host RAM" if budget[1].startswith(("host", "cgroup")) else "HBM")
    except ValueError as e:
      raise ValueError(f"--config.hardware={cfg.hardware} ({budget[1]}): {e}") from None
  return Setup(cfg, task, model_cfg, trainer_policy, sampler_policy, sampling, eval_sampling,
               update_cfg, schedule, plan, BatchConfig.from_rl(rl, rl.max_new_tokens), est,
               budget)


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
                    schedule: AsyncSchedule, seq_len: int) -> memory.MemoryEstimate:
  """The per-device memory estimate of one RL step of this run (lowrl.memory.estimate).

  What the loop holds: FP32 Adam moments over the master params (optimizer.master_dtype), the
  reference params when `uses_reference`, the schedule's parameter copies, the RL sampler's KV
  cache (all rows, the sampler policy's compute dtype; the eval samplers' caches are left out,
  as in lowrl.memory); each PPO minibatch is one optimizer step over `rl.micro_batches`
  forward/backward passes.
  """
  rl = cfg.rl
  rows = rl.num_prompts * rl.group_size
  data = plan.batch_shards
  stale = schedule.lag > 0 or schedule.sync_every > 1  # versions copied, stale ones re-scored
  master = cfg.optimizer.master_dtype
  # A host-stored copy is moved to the devices for the step that reads it: counted at full size.
  def stored(storage: str) -> str:
    return "bfloat16" if storage == "bfloat16" else master

  return memory.estimate(
      model_cfg, batch=rows, micro_batch=rows // rl.num_minibatches // rl.micro_batches,
      seq_len=seq_len,
      max_new_tokens=rl.max_new_tokens, mesh=(data, plan.mesh.size // data),
      param_dtype=master, optimizer_dtype="float32", compute_dtype=trainer_policy.compute_dtype,
      keep_reference=uses_reference(cfg), reference_dtype=stored(rl.ref_storage),
      async_versions=schedule.max_versions if stale else 0,
      async_dtype=stored(cfg.async_rl.version_storage),
      kv_cache_dtype=sampler_policy.compute_dtype, sampler_batch=rows, ppo_epochs=rl.mu,
      score_forwards=2 if stale else 1, minibatches=rl.num_minibatches)


def describe_memory(setup: Setup) -> str:
  """The setup's per-device memory estimate (and the budget it was checked against), as text."""
  name = setup.cfg.hardware
  hw = hardware.HARDWARE.get(name)
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


def _make_task(task_cfg: ml_collections.ConfigDict, hf_checkpoint: str = "") -> Task:
  """The task of a validated `config.task`, with both splits checked non-empty (before any SFT
  or compile). With a checkpoint, prompts are tokenized by its tokenizer (and rendered with its
  chat template when `task_cfg.chat_template`)."""
  kwargs = task_cfg.kwargs.to_dict()
  if task_cfg.name == "jsonl":
    kwargs.setdefault("path", task_cfg.path)
    kwargs.setdefault("verifier", task_cfg.verifier or "exact")
  if hf_checkpoint:
    kwargs.setdefault("tokenizer", hf_checkpoint)
    if task_cfg.chat_template:
      kwargs.setdefault("chat_template", hf_checkpoint)
    try:
      task = make_task(task_cfg.name, **kwargs)
    except (OSError, ValueError) as e:
      flag = ("task.chat_template" if "chat_template" in str(e)
              else f"model.hf_checkpoint={hf_checkpoint}")
      raise ValueError(f"--config.{flag}: {e}") from None
  else:
    task = make_task(task_cfg.name, **kwargs)
  for split in ("train", "eval"):
    task.sample(np.random.default_rng(0), 1, split)  # an empty split raises, naming the fix
  return task


def _model_config(model: ml_collections.ConfigDict, task: Task, max_len: int) -> ModelConfig:
  """The decoder of `config.model`: the tiny architecture of its knobs (vocabulary: the task's
  tokenizer), or a checkpoint's config.json (weights checked from the file headers) with the
  section's execution knobs."""
  knobs = model.to_dict()
  source = knobs.pop("hf_checkpoint")
  knobs.pop("param_dtype")
  scan = knobs.pop("scan_layers")
  if not source:
    return ModelConfig(vocab_size=task.tokenizer.vocab_size, max_seq_len=max_len,
                       scan_layers=bool(scan), **knobs)
  execution = {k: knobs[k] for k in ("remat", "attention", "attention_chunk", "logprob_chunk")}
  try:
    model_cfg = dataclasses.replace(hf.model_config_from_hf(hf.read_hf_config(source)),
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
  plan.param_specs(transformer.param_shapes(model_cfg))  # rule/shape mismatches raise here
  for what, policy in (("precision", trainer_policy), ("sampler precision", sampler_policy)):
    sharding.check_quant_blocks(policy, model_cfg, plan, seq_len=seq_len, what=what,
                                rows=rows // cfg.rl.num_minibatches // cfg.rl.micro_batches)
  return plan


def uses_reference(cfg: ml_collections.ConfigDict) -> bool:
  """Whether the run keeps reference params: for the KL penalty, or to log the KL to them."""
  return cfg.rl.kl_coef > 0 or cfg.rl.log_kl_ref


def _quant_key(policy: precision.PrecisionPolicy, key: jax.Array) -> jax.Array | None:
  return key if policy.needs_key else None


class Trainer:
  """Holds the jitted functions of one run; the state lives in plain pytrees."""

  def __init__(self, setup: Setup, log: Log = print):
    self.setup = setup
    self.log = log
    cfg = setup.cfg
    self.tx = optimizer.make_optimizer(cfg.optimizer, cfg.rl.steps * cfg.rl.mu
                                       * cfg.rl.num_minibatches)
    self.logprob_fn = loss_scaled(
        make_logprob_fn(setup.model_cfg, setup.trainer_policy, setup.sampling),
        cfg.optimizer.loss_scale)
    # The pure RL step the simulator also runs (lowrl.training.step), unjitted.
    # Every step runs on the mesh with explicit shardings: sampler and update take the same
    # sharded params (no gather in between), batches are split over the batch axes.
    self.plan = plan = setup.plan or sharding.single_device_plan()
    self.step_fn = make_step(self.logprob_fn, self.tx, setup.update_cfg, setup.batch_cfg, plan)
    self.param_shapes = transformer.param_shapes(setup.model_cfg)
    p_sh = plan.param_shardings(self.param_shapes)
    init_opt = lambda p: optimizer.init_opt_state(self.tx, p)  # noqa: E731
    o_sh = plan.shardings_like_params(jax.eval_shape(init_opt, self.param_shapes),
                                      self.param_shapes)
    self.init_opt_state = jax.jit(init_opt, in_shardings=(p_sh,), out_shardings=o_sh)
    ref_sh = p_sh if uses_reference(cfg) else plan.replicated
    batch, repl = plan.batch, plan.replicated
    self.step = jax.jit(self.step_fn, donate_argnums=(0, 1),
                        in_shardings=(p_sh, o_sh, ref_sh, batch, repl),
                        out_shardings=(p_sh, o_sh, repl))
    # Rollouts in the sampler's precision (exact mode: re-scored by the sampler's own policy).
    self.sampler = Sampler(setup.model_cfg, setup.sampler_policy, setup.sampling,
                           exact=cfg.sampler_exact, plan=plan)
    # Whether the exact-mode sampler's record can be the trainer's pi_old (sampler_scored_pi_old).
    self._exact_twin = (bool(cfg.sampler_exact) and setup.sampler_policy == setup.trainer_policy
                        and not setup.trainer_policy.act_paths(layout.matmuls(setup.model_cfg),
                                                               "tensor"))
    # Evaluation samples the trainer's policy: greedy, and at the rollout temperature.
    self.eval_sampler = Sampler(setup.model_cfg, setup.trainer_policy, setup.eval_sampling,
                                plan=plan)
    self.eval_sampler_t = Sampler(setup.model_cfg, setup.trainer_policy, setup.sampling,
                                  plan=plan)
    self._calibrate = jax.jit(transformer.calibrate_act_amax,
                              static_argnames=("model_cfg", "policy", "paths"))
    self.calib_tokens, self.calib_mask = self._calibration_batch(repl)
    # The sampler's weights between syncs (packed, + static scales) and the refit check.
    self.refit = refit.Refitter(setup.model_cfg, setup.sampler_policy,
                                lambda p: self.act_amax(p, setup.sampler_policy),
                                check_every=cfg.refit_check_every, log=log)
    # Gradient bias vs FP32 and update erasure (diagnostics.every): programs of their own (the
    # FP32 gradient's and the erasure's are the same for every recipe: the compile cache shares
    # them between runs).
    self._probe_fns = None
    if cfg.diagnostics.every:
      fp32 = precision.PrecisionPolicy.unquantized(layout.matmuls(setup.model_cfg), "float32",
                                                   name="fp32")
      grad_in = (p_sh, ref_sh, batch, repl)
      self._probe_fns = (
          jax.jit(probes.make_grad_fn(self.logprob_fn, setup.update_cfg, setup.batch_cfg),
                  in_shardings=grad_in, out_shardings=p_sh),
          jax.jit(probes.make_grad_fn(make_logprob_fn(setup.model_cfg, fp32, setup.sampling),
                                      setup.update_cfg, setup.batch_cfg, param_dtype="float32"),
                  in_shardings=grad_in, out_shardings=p_sh),
          jax.jit(probes.grad_agreement, out_shardings=repl),
          jax.jit(probes.make_erasure_fn(self.tx, cfg.optimizer.master_rounding),
                  in_shardings=(p_sh, p_sh, o_sh, repl), out_shardings=repl))
    self.weight_errors = jax.jit(
        lambda p: diagnostics.weight_quant_errors(p, setup.model_cfg, setup.trainer_policy),
        in_shardings=(p_sh,), out_shardings=repl)

  def state_shardings(self, state: Any) -> Any:
    """Shardings of a state tree: parameter-shaped leaves as the params, the rest replicated."""
    return self.plan.shardings_like_params(state, self.param_shapes)

  def place(self, state: Any) -> Any:
    """`state` on the mesh (every process must call this alike)."""
    return self.plan.put(state, self.state_shardings(state))

  def score(self, params, policy: precision.PrecisionPolicy, out: SampleOutput,
            key: jax.Array) -> jax.Array:
    """Logprobs of the sampled tokens under (params, policy): the exact-mode scoring program.

    The trainer's pi_old, the drift parts and the exact-mode sampler all go through this one
    jitted program, so equal inputs give bit-identical logprobs.
    """
    return rescore(out, params, model_cfg=self.setup.model_cfg, policy=policy,
                   config=self.setup.sampling, quant_key=_quant_key(policy, key),
                   plan=self.plan).logprobs  # log q: the sampled distribution (temperature etc.)

  def act_amax(self, params, policy: precision.PrecisionPolicy) -> dict[str, jax.Array] | None:
    """Static activation scales for sampling `params` under `policy` (None if it needs none).

    A recipe that scales activations per tensor samples with static amaxes, as inference engines
    do: calibrated (max |input| per matmul, trainer's precision) on a fixed batch of train prompts
    + reference answers from the weights being sampled, i.e. recalibrated at every weight sync.
    """
    paths = calibration_paths(policy, self.setup.model_cfg)  # + a quantized KV cache's K/V
    if not paths:
      return None
    tp = self.setup.trainer_policy
    return self._calibrate(params, self.calib_tokens, model_cfg=self.setup.model_cfg, policy=tp,
                           paths=paths, mask_BT=self.calib_mask,
                           quant_key=_quant_key(tp, jax.random.key(self.setup.cfg.seed)))

  def _calibration_batch(self, sharding_) -> tuple[jax.Array, jax.Array]:
    """64 fixed train examples, prompt + answer + eos (right-padded), and their token mask."""
    task = self.setup.task
    examples = task.sample(np.random.default_rng([self.setup.cfg.seed, 5]), 64, "train")
    tokens, target_mask = encode_sft(task.tokenizer, [e.prompt for e in examples],
                                     [task.target_text(e) for e in examples],
                                     task.max_prompt_len + task.max_answer_len)
    ends = target_mask.shape[1] - np.argmax(target_mask[:, ::-1] > 0, axis=1)
    mask = np.arange(tokens.shape[1])[None, :] < ends[:, None]
    return self.plan.put((jnp.asarray(tokens), jnp.asarray(mask)), sharding_)

  # -- data -------------------------------------------------------------------------------------

  def prompts(self, step: int):
    """The step's prompts (data position = step), each repeated group_size times."""
    cfg = self.setup.cfg
    rng = np.random.default_rng([cfg.seed, 2, step])
    examples = self.setup.task.sample(rng, cfg.rl.num_prompts, "train")
    examples = [e for e in examples for _ in range(cfg.rl.group_size)]
    tokens, lens = encode_prompts(self.setup.task.tokenizer, [e.prompt for e in examples],
                                  self.setup.task.max_prompt_len)
    mask = np.arange(tokens.shape[1])[None, :] < lens[:, None]
    return examples, jnp.asarray(tokens), jnp.asarray(mask)

  def rewards(self, out: SampleOutput, examples) -> tuple[np.ndarray, list[str]]:
    """The task verifier's float32 [B] rewards of the completions (host), and their text."""
    tokens = distributed.to_host(out.tokens)
    completions = decode_batch(self.setup.task.tokenizer, tokens,
                               np.full((tokens.shape[0],), out.prompt_width))
    return self.setup.task.rewards(completions, examples).astype(np.float32), completions

  # -- evaluation -------------------------------------------------------------------------------

  def evaluate(self, params, key: jax.Array) -> dict[str, float]:
    """Held-out evaluation on a fixed set of eval-split prompts (`evaluation.eval_metrics`).

    pass_at_1: the success rate of one sample at the rollout temperature (the unbiased estimate
    from `eval_samples` samples per prompt, as RL papers report it); greedy: temperature-0
    accuracy; reward: mean reward of the samples.
    """
    examples, tokens, mask = self._eval_prompts()
    k_greedy, k_sample = jax.random.split(key)
    qk = _quant_key(self.setup.trainer_policy, key)
    act_amax = self.act_amax(params, self.setup.trainer_policy)
    out = self.eval_sampler(params, jnp.asarray(tokens), jnp.asarray(mask), k_greedy,
                            quant_key=qk, act_amax=act_amax)
    greedy, _ = self.rewards(out, examples)
    sampled = np.concatenate([self.rewards(out, chunk)[0] for out, chunk in self._eval_samples(
        params, k_sample, quant_key=qk, act_amax=act_amax)])
    m = eval_metrics(greedy, sampled)
    # "pass_at_1", not "pass@1": TensorBoard tag names cannot hold "@".
    return {k: float(m[k]) for k in ("pass_at_1", "greedy", "reward")}

  def _eval_samples(self, params, key: jax.Array, *, quant_key: jax.Array | None,
                    act_amax: transformer.ActAmax | None) -> list[tuple[SampleOutput, list]]:
    """`eval_samples` completions of every held-out prompt at the rollout temperature, from the
    trainer's policy, as (SampleOutput, examples) chunks of a rollout's rows (the last one may be
    smaller), chunk i sampled with fold_in(key, i).

    A chunk the size of a rollout makes evaluation (and `policy_kl`'s scoring) run the rollout's
    own sampling and scoring programs when the sampler and the trainer share a recipe, instead
    of compiling programs for the eval batch, and it needs no more device memory than a rollout.
    """
    cfg = self.setup.cfg
    examples, tokens, mask = self._eval_prompts()
    n = cfg.eval_samples
    examples = [e for e in examples for _ in range(n)]
    tokens, mask = np.repeat(tokens, n, 0), np.repeat(mask, n, 0)
    rows = cfg.rl.num_prompts * cfg.rl.group_size
    return [(self.eval_sampler_t(params, jnp.asarray(tokens[i:i + rows]),
                                 jnp.asarray(mask[i:i + rows]), jax.random.fold_in(key, i // rows),
                                 quant_key=quant_key, act_amax=act_amax), examples[i:i + rows])
            for i in range(0, len(examples), rows)]

  def _eval_prompts(self) -> tuple[list, np.ndarray, np.ndarray]:
    """The fixed held-out prompts (eval split, `eval_num_prompts`), left-padded, and their mask."""
    cfg = self.setup.cfg
    rng = np.random.default_rng([cfg.seed, 3])
    examples = self.setup.task.sample(rng, cfg.eval_num_prompts, "eval")
    tokens, lens = encode_prompts(self.setup.task.tokenizer, [e.prompt for e in examples],
                                  self.setup.task.max_prompt_len)
    return examples, tokens, np.arange(tokens.shape[1])[None, :] < lens[:, None]

  def policy_kl(self, params, other_params, other_policy: precision.PrecisionPolicy,
                key: jax.Array) -> dict[str, float]:
    """KL(pi || pi_other) per completion token on the held-out prompts.

    pi = `params` under this run's trainer policy, pi_other = `other_params` under
    `other_policy` (e.g. a BF16 twin run's final params); both the distribution sampled at the
    rollout temperature. `eval_samples` completions per held-out prompt are sampled from pi
    (as `evaluate` samples), and both policies score them with the exact-mode scoring program;
    returns {"kl": k1 mean, "kl_k3": k3 mean, "abs_dlogp_mean": ...} (`mismatch_metrics` of
    logp_pi - logp_other: unbiased estimates of KL(pi || pi_other) on pi's samples).
    """
    tp = self.setup.trainer_policy
    logp, logp_other, mask = [], [], []
    for out, _ in self._eval_samples(params, key, quant_key=_quant_key(tp, key),
                                     act_amax=self.act_amax(params, tp)):
      logp.append(self.score(params, tp, out, key))
      logp_other.append(self.score(other_params, other_policy, out, key))
      mask.append(out.completion_mask)
    m = mismatch_metrics(jnp.concatenate(logp), jnp.concatenate(logp_other),
                         jnp.concatenate(mask))
    return {"kl": float(m["mismatch_kl"]), "kl_k3": float(m["mismatch_kl_k3"]),
            "abs_dlogp_mean": float(m["abs_dlogp_mean"])}

  # -- one step ---------------------------------------------------------------------------------

  def rollout(self, sampler_params, params, step: int, key: jax.Array,
              stale: bool, sampler_version: int | None = None) -> tuple[Rollout, dict[str, Any]]:
    """Samples the step's batch with `sampler_params` (in the sampler's precision) and scores it.

    The trainer scores the sampled tokens with the current `params` in the trainer's precision
    (pi_old) and, when the sampler's version is `stale`, with the sampler's weights in the
    trainer's precision, for the drift decomposition. The sampler generates from the
    `RolloutWeights` of `sampler_version` (`self.refit`: re-quantized when the version changes,
    i.e. at each weight sync; None = every call). Returns (the step's Rollout, host info:
    rewards, completions, examples, refit metrics).
    """
    examples, tokens_BP, mask_BP = self.prompts(step)
    k_sample, k_quant = jax.random.split(key)
    # Exact mode re-scores in the sampler's precision with the same key it sampled with.
    sampler_qk = _quant_key(self.setup.sampler_policy, k_quant)
    held, refit_metrics = self.refit(sampler_params, sampler_version)
    act_amax = held.act_amax  # + a quantized KV cache's K/V amaxes
    out = self.sampler(held.weights, tokens_BP, mask_BP, k_sample, quant_key=sampler_qk,
                       trainer_params=sampler_params, trainer_quant_key=sampler_qk,
                       act_amax=act_amax)
    logp_now_BT = (out.logprobs if self.sampler_scored_pi_old(sampler_params, params, stale)
                   else self.score(params, self.setup.trainer_policy, out, k_quant))
    logp_stale_BT = (self.score(sampler_params, self.setup.trainer_policy, out, k_quant) if stale
                     else logp_now_BT)
    rewards, completions = self.rewards(out, examples)
    rollout = self.plan.put(Rollout(out, jnp.asarray(rewards), logp_now_BT, logp_stale_BT),
                            self.plan.batch)
    return rollout, {"rewards": rewards, "completions": completions, "examples": examples,
                     "refit": refit_metrics,
                     "kv": kv_share_metrics(  # {} without a quantized KV cache
                         out, sampler_params, model_cfg=self.setup.model_cfg,
                         policy=self.setup.sampler_policy, config=self.setup.sampling,
                         quant_key=sampler_qk, plan=self.plan, act_amax=act_amax)}

  def sampler_scored_pi_old(self, sampler_params, params, stale: bool) -> bool:
    """Whether the sampler's recorded logprobs are provably the trainer's pi_old, so `rollout`
    skips the second scoring pass.

    Exact mode records `rescore(out, sampler_params, policy=sampler policy, quant_key=k,
    act_amax=static scales)`; pi_old is `rescore(out, params, policy=trainer policy,
    quant_key=k', act_amax=None)`. With the same policy (then k' = k, and the same cached jitted
    program), no tensor-scaled activations (so both act_amax are None) and `sampler_params`
    the very buffers of `params` (not stale, no copy: lag 0, sync every step), both calls run one
    program on identical inputs, which is bit-identical; the mismatch metrics are then exactly 0
    either way.
    """
    if not self._exact_twin or stale:
      return False
    ours, theirs = jax.tree.leaves(sampler_params), jax.tree.leaves(params)
    return len(ours) == len(theirs) and all(a is b for a, b in zip(ours, theirs))

  def probe(self, params, opt_state, ref_params, rollout: Rollout, key: jax.Array
            ) -> dict[str, jax.Array]:
    """`lowrl.training.probes` on the step's rollout, before its update: the trainer's gradient
    vs the FP32 one (`grad_bias/*`) and the erasure of one optimizer step on the trainer's
    gradient (`update_erasure`). Needs diagnostics.every > 0."""
    grad_q, grad_32, agreement, erasure = self._probe_fns
    k_grad, k_opt = jax.random.split(key)
    g_q = grad_q(params, ref_params, rollout, k_grad)
    metrics = agreement(g_q, grad_32(params, ref_params, rollout, k_grad))
    return {**metrics, "update_erasure": erasure(params, g_q, opt_state, k_opt)}

  def rl_step(self, sampler_params, params, opt_state, ref_params, step: int, key: jax.Array,
              stale: bool, probe: bool = False, sampler_version: int | None = None
              ) -> tuple[Any, Any, dict[str, jax.Array], dict[str, Any]]:
    """One RL step: rollout, then the jitted step (donates `params` and `opt_state`).

    `key` is the step's key (fold_in(run key, step)). `probe`: also run the gradient-bias /
    update-erasure probe (`lowrl.training.probes`) on the rollout, before the step, with a key
    of its own (the step's keys and numbers are unchanged). Returns (params, opt_state, metrics,
    host info of the rollout).
    """
    k_roll, k_upd = jax.random.split(key)
    rollout, info = self.rollout(sampler_params, params, step, k_roll, stale=stale,
                                 sampler_version=sampler_version)
    probe_metrics = {}
    if probe and self._probe_fns is not None:
      probe_metrics = self.probe(params, opt_state, ref_params, rollout,
                                 jax.random.fold_in(key, _PROBE_STREAM))
    params, opt_state, metrics = self.step(params, opt_state, ref_params, rollout, k_upd)
    return params, opt_state, {**metrics, **probe_metrics, **info["kv"], **info["refit"]}, info


class NonFiniteError(RuntimeError):
  """Training produced non-finite updates for `max_skipped_steps` steps in a row."""


def run(cfg: ml_collections.ConfigDict, workdir: str, log: Log = print, *,
        allow_config_change: bool = False, reevaluate: bool = False) -> dict[str, Any]:
  """Runs (or resumes) the whole pipeline in `workdir`; returns the summary.

  A workdir holding a finished run returns its summary without running anything (`reevaluate`:
  evaluate the final parameters again and rewrite summary.json). Resuming under a changed config
  raises run_config.ConfigChangedError unless `allow_config_change`.
  """
  try:
    setup = build(cfg)  # every config error surfaces here, before any compile
  except ValueError as e:
    raise run_config.ConfigError(str(e)) from e
  primary = distributed.is_primary()  # only process 0 logs and writes files (orbax: all save)
  if not primary:
    log = lambda _: None  # noqa: E731
  if not reevaluate and not disk.writable(workdir):  # a finished run is still shown
    summary = run_logs.finished_summary(workdir, cfg.rl.steps)
    if summary is not None:
      return _show_finished(summary, workdir, cfg, log)
  stale = setup.schedule.lag > 0 or setup.schedule.sync_every > 1
  disk.check_workdir(workdir, disk.needed_bytes(
      cfg, setup.model_cfg.num_params(), os.path.join(workdir, "checkpoints"),
      keep_reference=uses_reference(cfg), versions=setup.schedule.max_versions if stale else 0))
  with (WorkdirLock(workdir, log) if primary else contextlib.nullcontext()), \
      preemption.stop_on_signals() as stop, disk.one_line_when_full():
    try:
      return _run_in_workdir(setup, workdir, log, stop, allow_config_change=allow_config_change,
                             reevaluate=reevaluate)
    except Exception as e:
      if not disk.is_disk_full(e, workdir):
        raise
      raise disk.DiskFullError(disk.full_message(workdir, os.path.join(workdir, "checkpoints"))
                               ) from None


def _show_finished(summary: dict[str, Any], workdir: str, cfg: ml_collections.ConfigDict,
                   log: Log) -> dict[str, Any]:
  log(f"[done] {workdir} holds a finished run ({cfg.rl.steps} steps); nothing to do "
      "(--reevaluate evaluates it again).")
  log(json.dumps(summary, indent=2))
  return summary


def _run_in_workdir(setup: Setup, workdir: str, log: Log, stop: preemption.StopFlag, *,
                    allow_config_change: bool, reevaluate: bool) -> dict[str, Any]:
  """`run` once the workdir is checked and locked."""
  cfg, primary = setup.cfg, distributed.is_primary()
  ckpt, resuming = _open_workdir(cfg, workdir, log, allow_config_change)
  summary = run_logs.finished_summary(workdir, cfg.rl.steps)
  if summary is not None and not reevaluate:
    return _show_finished(summary, workdir, cfg, log)
  _log_setup(setup, workdir, log)

  t0 = time.time()
  tb_dir = os.path.join(workdir, run_logs.TB_DIR)
  base_dir = base_store.store_dir(cfg.sft.base_dir, workdir)
  # The SFT loss (when this run trains the base) goes to a TensorBoard run of its own, `tb/sft`:
  # its steps are SFT steps, and a resume's purge of RL steps must not touch them.
  with create_writer(os.path.join(tb_dir, tb_layout.SFT_RUN),
                     enabled=primary and not resuming) as sft_tb:
    base = _load_base(base_dir, setup, log,
                      on_sft_loss=lambda i, v: sft_tb.scalars(i, {"sft/loss": v}))
  trainer = Trainer(setup, log)
  start, state, versions = _initial_state(setup, trainer, ckpt, base, resuming, workdir, log)

  # Points logged after the resumed checkpoint (before an interruption) are replaced.
  writer = create_writer(os.path.join(tb_dir, tb_layout.RL_RUN), enabled=primary,
                         purge_step=start + 1 if start else None, tags=tb_layout.tag)
  try:
    summary = _train(setup, trainer, ckpt, writer, workdir, start, state, versions, log,
                     reevaluate=reevaluate and start == cfg.rl.steps, stop=stop)
  finally:
    writer.close()  # flushes: points logged before an error are kept
    ckpt.wait()  # a save still in flight is completed and verified, also after an error
  summary["wall_s"] = time.time() - t0
  if primary:
    run_logs.write_json(workdir, run_logs.SUMMARY, summary)
  ev0, ev1 = summary["eval_start"], summary["eval_end"]
  log(f"[eval] held-out pass@1: start {ev0['pass_at_1']:.3f} -> end {ev1['pass_at_1']:.3f}; "
      f"greedy: start {ev0['greedy']:.3f} -> end {ev1['greedy']:.3f} "
      f"(wall {summary['wall_s']:.0f}s)")
  return summary


def _open_workdir(cfg: ml_collections.ConfigDict, workdir: str, log: Log,
                  allow_config_change: bool) -> tuple[Checkpointer, bool]:
  """The run's checkpointer and whether it resumes; checks (or writes) the workdir's config.

  An earlier attempt's logs without a checkpoint to resume from are moved aside.
  """
  primary = distributed.is_primary()
  os.makedirs(workdir, exist_ok=True)
  # Asynchronous: a save's files are written while the next steps train.
  ckpt = Checkpointer(os.path.join(workdir, "checkpoints"), every=cfg.checkpoint_every,
                      async_save=True)
  steps = ckpt.all_steps()
  resuming = bool(steps)
  if resuming and primary:  # damaged bookkeeping: one line, before anything is compiled
    run_logs.check_resumable(workdir)
  if ckpt.unfinished:
    log(f"[checkpoint] removed unfinished saves {ckpt.unfinished} (never restorable)")
  if not resuming and primary and run_logs.has_logs(workdir):
    dest = run_logs.move_aside(workdir)
    log(f"[warn] {workdir} has logs of an earlier attempt but no finished checkpoint: they were "
        f"moved to {dest}; starting from step 0.")
  newest = read_meta(ckpt.step_dir(steps[-1])) if steps else None
  changes = run_config.check_or_write(workdir, cfg, resuming=resuming,
                                      allow_change=allow_config_change, write=primary,
                                      checkpoint_fingerprint=(newest or {}).get(
                                          "config_fingerprint"))
  log("[config]\n" + run_config.describe(cfg))
  for c in changes:
    log(f"[config] changed since the last start (--allow_config_change): {c}")
  return ckpt, resuming


def _log_setup(setup: Setup, workdir: str, log: Log) -> None:
  """The run's static setup: task, model, recipes, schedule, precision table, mesh."""
  cfg = setup.cfg
  if cfg.model.hf_checkpoint:
    log(f"[setup] model {cfg.model.hf_checkpoint} (scan_layers={setup.model_cfg.scan_layers}); "
        f"completions stop at eos ids {setup.sampling.stop_tokens}")
  log(f"[setup] task={cfg.task.name} model={setup.model_cfg.num_params():,} params "
      f"trainer={setup.trainer_policy.name} sampler={setup.sampler_policy.name} "
      f"async lag={setup.schedule.lag} sync_every={setup.schedule.sync_every} "
      f"config {run_config.fingerprint(cfg)} ({os.path.join(workdir, run_config.CONFIG_FILE)})")
  log(precision.format_table(precision.assignment_table(setup.trainer_policy,
                                                          layout.matmuls(setup.model_cfg))))
  log(f"[mesh] {dict(setup.plan.mesh.shape)} over {jax.device_count()} {jax.default_backend()} "
      f"devices, {jax.process_count()} process(es)")
  for note in setup.plan.fallbacks(transformer.param_shapes(setup.model_cfg)):
    log(f"[mesh] {note}")
  log(describe_memory(setup))
  cache_note = setup.plan.cache_note(setup.model_cfg)
  if cache_note:
    log(f"[warn] {cache_note}")


def _initial_state(setup: Setup, trainer: Trainer, ckpt: Checkpointer, base, resuming: bool,
                   workdir: str, log: Log) -> tuple[int, dict[str, Any], VersionBuffer]:
  """(start step, state tree, version buffer): from the base, or from the newest intact
  checkpoint when resuming. The state tree is `_state`'s, on the mesh."""
  cfg = setup.cfg
  base = trainer.place(optimizer.to_master(base, cfg.optimizer.master_dtype))
  # The update donates `params`: the reference needs buffers of its own (`storage.keep`).
  ref = storage.keep(base, cfg.rl.ref_storage) if uses_reference(cfg) else None
  state = _state(base, trainer.init_opt_state(base),
                 jax.random.key_data(jax.random.key(cfg.seed)), ref, {})
  host_ref = cfg.rl.ref_storage == "host" and ref is not None
  state = trainer.place({k: v for k, v in state.items() if not (host_ref and k == "ref_params")})
  if host_ref:  # `place` would move it to device memory
    state["ref_params"] = ref
  start = 0
  if resuming:
    def abstract_for(step: int):
      shapes = jax.eval_shape(lambda: _with_versions(state, setup, step))
      # Restores onto this run's mesh, whatever mesh saved it.
      return sharding.abstract(shapes, trainer.state_shardings(shapes))
    state, meta, start = ckpt.restore_newest_intact(abstract_for, log)
    log(f"[resume] from step {start} (data position {meta['data_position']}) in {workdir}")
    if "ref_params" in state:  # restored onto the devices: back where the run keeps it
      state["ref_params"] = storage.keep(state["ref_params"], cfg.rl.ref_storage)
  versions = VersionBuffer(setup.schedule)
  for v, p in state.get("versions", {}).items():
    versions.put(int(v), storage.keep(p, cfg.async_rl.version_storage))
  return start, state, versions


def _eval_start(setup: Setup, trainer: Trainer, writer, workdir: str, start: int, params,
                eval_key: jax.Array, log: Log) -> dict[str, float]:
  """The step-0 evaluation: run (and logged) at a fresh start, read back when resuming."""
  cfg = setup.cfg
  primary = distributed.is_primary()
  if start:
    eval_start = run_logs.read_json(workdir, run_logs.EVAL_START, run_logs.EVAL_START_FIX)
    if primary:
      run_logs.trim_metrics(workdir, start)
    return eval_start
  if primary:
    open(os.path.join(workdir, run_logs.METRICS), "w").close()
  ev = trainer.evaluate(params, eval_key)
  log(f"[eval] step 0 held-out pass@1 {ev['pass_at_1']:.3f} greedy {ev['greedy']:.3f}")
  writer.scalars(0, {f"eval/{k}": v for k, v in ev.items()})
  writer.texts(0, {"config": "```\n" + run_config.describe(cfg) + "\n```"})
  writer.hparams(run_config.flatten(cfg), ["eval/pass_at_1", "eval/greedy", "reward/mean"])
  writer.custom_scalars(tb_layout.custom_scalars())
  if primary:
    run_logs.write_json(workdir, run_logs.EVAL_START, ev)
  return ev


def _log_order(metrics: dict[str, Any]) -> dict[str, Any]:
  """The step's metrics in metrics.jsonl's column order: the update's, the drift parts, then
  `make_batch`'s (a jitted dict comes back sorted)."""
  drift = sorted(k for k in metrics if k.startswith("drift/"))
  update = sorted(k for k in metrics if k not in BATCH_METRICS and not k.startswith("drift/"))
  return {k: metrics[k] for k in (*update, *drift, *BATCH_METRICS)}


def _train(setup: Setup, trainer: Trainer, ckpt: Checkpointer, writer, workdir: str, start: int,
           state: dict[str, Any], versions: VersionBuffer, log: Log, *,
           reevaluate: bool, stop: preemption.StopFlag | None = None) -> dict[str, Any]:
  """The RL steps from `start`, then the final evaluation; returns the summary (no wall time).

  When `stop` is set (SIGTERM/SIGINT) the step in progress finishes, is checkpointed and waited
  for, the logs are flushed, and preemption.Preempted is raised."""
  cfg, rl = setup.cfg, setup.cfg.rl
  primary = distributed.is_primary()
  use_ref = uses_reference(cfg)
  params, opt_state = state["params"], state["opt_state"]
  ref_params = state.get("ref_params")
  base_key = jax.random.wrap_key_data(state["rng"])
  metrics_path = os.path.join(workdir, run_logs.METRICS)
  eval_key = jax.random.fold_in(base_key, -1 % 2**31)
  eval_start = _eval_start(setup, trainer, writer, workdir, start, params, eval_key, log)

  # Only the schedule's versions need copies: the step donates (and so frees) `params`.
  needs_copy = setup.schedule.lag > 0 or setup.schedule.sync_every > 1
  copy = ((lambda t: storage.keep(t, cfg.async_rl.version_storage)) if needs_copy
          else (lambda t: t))
  versions.put(start, copy(params))
  eta = run_logs.Eta(rl.steps)
  skipped_in_a_row = 0
  fp = run_config.fingerprint(cfg)
  if preemption.agreed(stop):  # signalled while the base trained or the programs compiled
    raise preemption.Preempted(stop.signame or "a signal", None, workdir)
  step_pace = pace.Pace(cfg)
  for step in range(start, rl.steps):
    step_pace.start()
    sv = setup.schedule.sampler_version(step)
    every = cfg.diagnostics.every
    params, opt_state, m, info = trainer.rl_step(storage.use(versions.get(sv)), params,
                                                 opt_state, storage.use(ref_params),
                                                 step, jax.random.fold_in(base_key, step),
                                                 stale=sv != step,
                                                 probe=bool(every) and step % every == 0,
                                                 sampler_version=sv)
    versions.put(step + 1, copy(params))
    versions.evict_before(step + 1)
    if use_ref and rl.ref_reset_every and (step + 1) % rl.ref_reset_every == 0:
      ref_params = storage.keep(params, rl.ref_storage)

    m = {k: float(v) for k, v in _log_order(m).items()}
    m.update({"sampler_version_lag": float(step - sv), "versions_held": float(len(versions))})
    tb_only = step_pace.scalars(step, m["response_length"])  # wall times: not in metrics.jsonl
    done = step + 1
    skipped_in_a_row = skipped_in_a_row + 1 if m["skipped_updates"] > 0 else 0
    if skipped_in_a_row:
      log(f"[warn] step {done}: {int(m['skipped_updates'])} optimizer step(s) skipped "
          "(non-finite loss, gradient or update)")
    if cfg.eval_every and done % cfg.eval_every == 0 and done < rl.steps:
      ev = trainer.evaluate(params, eval_key)
      m.update({f"eval/{k}": v for k, v in ev.items()})
      log(f"[eval] step {done} held-out pass@1 {ev['pass_at_1']:.3f} greedy {ev['greedy']:.3f}")
    if done % cfg.log_every == 0 or done == rl.steps:
      _log_step(trainer, writer, metrics_path, done, params, m, info, eta, log, tb_only)
    if skipped_in_a_row >= cfg.max_skipped_steps:
      raise NonFiniteError(
          f"{skipped_in_a_row} consecutive steps (up to step {done}) had skipped optimizer "
          f"updates (non-finite loss, gradient or update); stopping. {ckpt.last_good_hint()} "
          "Lower --config.optimizer.lr or raise the precision, then re-run to resume from it "
          "(--allow_config_change), or raise --config.max_skipped_steps.")
    if done % cfg.checkpoint_every == 0 or done == rl.steps:
      writer.flush()  # the points up to the checkpoint survive a kill
    # The newest version is `params` itself: only older ones are saved separately.
    state = _state(params, opt_state, jax.random.key_data(base_key), ref_params,
                   {str(v): versions.get(v) for v in versions.versions() if v != done})
    stopping = preemption.agreed(stop)
    ckpt.save(done, state, {"data_position": done, "step": done, "config_fingerprint": fp},
              force=done == rl.steps or stopping)
    if stopping:
      ckpt.wait()
      writer.flush()
      raise preemption.Preempted(stop.signame or "a signal", done, workdir)
  ckpt.wait()

  ev_end = trainer.evaluate(params, eval_key)
  if not reevaluate:  # a re-evaluation must not add a second point at the last step
    writer.scalars(rl.steps, {f"eval/{k}": v for k, v in ev_end.items()})
  lines = run_logs.read_metrics(workdir) if primary else []
  return {"eval_start": eval_start, "eval_end": ev_end, "steps": rl.steps,
          "final_train_reward": lines[-1].get("reward/mean") if lines else None,
          "config_fingerprint": run_config.fingerprint(cfg)}


def _log_step(trainer: Trainer, writer, metrics_path: str, done: int, params,
              m: dict[str, float], info: dict[str, Any], eta: run_logs.Eta, log: Log,
              tb_only: dict[str, float]) -> None:
  """Step `done`'s point: weight quantization errors added to `m`, TensorBoard (`m` and
  `tb_only`), metrics.jsonl (`m`), the console line."""
  werr = {k: float(v) for k, v in trainer.weight_errors(params).items()}
  if werr:
    writer.histograms(done, {tb_layout.WEIGHT_ERROR_HISTOGRAM:
                             100 * np.array(list(werr.values()))})
    m.update({f"quant_error/{k}": v for k, v in werr.items()})
  writer.scalars(done, {**m, **tb_only})
  writer.texts(done, {"samples": _sample_text(info, trainer.setup.cfg.num_text_samples)})
  if distributed.is_primary():
    with open(metrics_path, "a") as f:
      f.write(run_logs.metrics_line(done, m) + "\n")
  steps = trainer.setup.cfg.rl.steps
  log(f"[rl] step {done}/{steps} reward {m['reward/mean']:.3f} "
      f"pass {m['reward/pass_rate']:.3f} mismatch_kl {m['mismatch/mismatch_kl']:.2e} "
      f"ess {m['mismatch/ess']:.3f} len {m['response_length']:.1f} {eta.update(done)}")


def _load_base(base_dir: str, setup: Setup, log: Log,
               on_sft_loss: Callable[[int, float], None] | None = None) -> Any:
  """The mid-trained base from the store `base_dir` (`base_store.load_mid_trained`: trained and
  published there if missing or damaged), replicated over the mesh; or, with
  `model.hf_checkpoint`, the checkpoint's params placed with the mesh's parameter shardings."""
  cfg = setup.cfg
  shapes = transformer.param_shapes(setup.model_cfg)
  if cfg.model.hf_checkpoint:
    # Straight onto the mesh: each process reads only the slices its devices hold.
    log(f"[base] loading {cfg.model.hf_checkpoint} ({cfg.model.param_dtype}, sharded)")
    return hf.load_hf_params(cfg.model.hf_checkpoint, setup.model_cfg,
                             dtype=jnp.dtype(cfg.model.param_dtype),
                             shardings=setup.plan.param_shardings(shapes))
  return base_store.load_mid_trained(base_dir, setup.task, cfg, setup.model_cfg, setup.plan,
                                     base_seed(cfg), log, on_sft_loss)


def base_seed(cfg: ml_collections.ConfigDict) -> int:
  """The seed the run's base is trained with: `sft.seed`, or the run's seed when it is -1."""
  return cfg.sft.seed if cfg.sft.seed >= 0 else cfg.seed


def load_base(cfg: ml_collections.ConfigDict, workdir: str, log: Log = print) -> Any:
  """The base params a run of `cfg` in `workdir` starts from (trained and saved if missing)."""
  setup = build(cfg)
  return _load_base(base_store.store_dir(cfg.sft.base_dir, workdir), setup, log)


def final_params(cfg: ml_collections.ConfigDict, workdir: str, trainer: Trainer | None = None
                 ) -> Any:
  """The policy params of the finished run of `cfg` in `workdir` (its step-`rl.steps`
  checkpoint, checksums verified), on `trainer`'s mesh (a Trainer of `cfg` built if None)."""
  trainer = trainer or Trainer(build(cfg), log=lambda _: None)
  setup, steps = trainer.setup, cfg.rl.steps
  params = jax.eval_shape(lambda p: optimizer.to_master(p, cfg.optimizer.master_dtype),
                          trainer.param_shapes)
  state = jax.eval_shape(lambda p: _state(
      p, optimizer.init_opt_state(trainer.tx, p), jax.random.key_data(jax.random.key(0)),
      p if uses_reference(cfg) else None, {}), params)
  state = _with_versions(state, setup, steps)
  ckpt = Checkpointer(os.path.join(workdir, "checkpoints"), every=cfg.checkpoint_every)
  restored, _, _ = ckpt.restore(sharding.abstract(state, trainer.state_shardings(state)),
                                step=steps)
  return restored["params"]


def _state(params, opt_state, rng, ref_params, versions: dict[str, Any]) -> dict[str, Any]:
  """The checkpointed tree; absent entries are left out (orbax stores no None leaves)."""
  state = {"params": params, "opt_state": opt_state, "rng": rng}
  if ref_params is not None:
    state["ref_params"] = ref_params
  if versions:
    state["versions"] = versions
  return state


def _with_versions(state, setup: Setup, step: int):
  """The state tree a checkpoint at `step` holds (which old versions it has depends on the step)."""
  buf = VersionBuffer(setup.schedule)
  for v in range(step + 1):
    buf.put(v, state["params"])
  buf.evict_before(step)
  old = {str(v): state["params"] for v in buf.versions() if v != step}
  return _state(state["params"], state["opt_state"], state["rng"], state.get("ref_params"), old)


def _sample_text(info, n: int) -> str:
  rows = []
  for e, c, r in list(zip(info["examples"], info["completions"], info["rewards"]))[:n]:
    rows.append(f"`{e.prompt}` -> `{c}` (answer `{e.answer}`, reward {r:g})")
  return "\n\n".join(rows)
