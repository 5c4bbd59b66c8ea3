"""A fast asynchronous-RL simulator: all the policy updates of a run are one jitted `lax.scan`.

The pieces are the real loop's (lowrl.training.loop), called from inside the scan: the decoder
(`lowrl.models.transformer`) under the sampler's and the trainer's precision policies
(`lowrl.precision`, quantized through `lowrl.quant`), the sampler's prefill + decode
(`lowrl.sampling.generate_in_jit`, exact mode re-scoring included), the loop's RL step
(`lowrl.training.step.make_step`: overlong penalty, group advantages, dynamic sampling, the drift
decomposition and the pure update with its losses, TIS/MIS corrections, KL to a reference and
optimizer), the supervised step of the loop's base (`lowrl.training.sft.make_sft_step`) and the
staleness schedule (`AsyncSchedule`). What is small is the rest:
a tiny decoder on a synthetic sequential task whose reward is computed in JAX (`SequenceTask`),
so nothing leaves the device between updates and thousands of updates run per minute on a CPU.

Asynchrony inside the scan: the VersionBuffer becomes a ring of parameter slots (a stacked
pytree). `AsyncSchedule.ring_plan` says, per step, whether the current params are synced into a
slot and which slot holds the version that samples the step's batch; the version number stored
with each slot is logged (`sampler_version`), so a test can check that the scan sampled with
exactly `AsyncSchedule.sampler_version(t)`.

A run (`simulate`, vmapped over seeds): `initial_params` (random init + optional supervised warm
start), greedy `evaluate` in the trainer's precision on the held-out split (`SequenceTask.prompts`:
problems training never draws), the training scan (`make_train`), `evaluate` again. Step t of the scan (its keys from fold_in(k_steps, t)):
  1. sync: if t % sync_every == 0, params (version t) go into their ring slot;
  2. sample: the ring's version sampler_version(t), in the sampler's precision, generates
     group_size completions for each of num_prompts prompts (temperature 1);
  3. reward in JAX;
  4. the trainer scores the batch with the sampler's (stale) weights and with the current
     weights (pi_old), both in the trainer's precision, and the current weights are scored in the
     sampler's precision (the fourth score of the order-symmetric drift split, lowrl.rl.drift;
     with identical recipes it is pi_old itself);
  5. the loop's RL step: batch (advantages), drift (quantization / staleness / total parts), the
     pure update (correction, KL to the starting policy when rl.kl_coef > 0, mu x
     num_minibatches optimizer steps).
Every step's scalar metrics come back as [steps] arrays.

Schedules (`async_rl.schedule`): fifo (default), independent and length change only the ring plan
(which slot samples step t); pipeline (PipelineSchedule) draws completion token j from the slot
`token_read_slot[t, j]` (`pipeline_rollout`) and takes each token's stale score from the trainer's
scores under every slot. lag='auto' and the run's clock come from lowrl.asyncrl.timing.
"""
from __future__ import annotations

import dataclasses
import functools
import time
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax

from lowrl import hardware as hardware_lib
from lowrl import precision, quant_blocks, sharding
from lowrl.asyncrl import timing
from lowrl.models import calibration, init, layout, transformer
from lowrl.models.config import ModelConfig
from lowrl.rl.corrections import CorrectionConfig
from lowrl.rl.drift import version_distance
from lowrl.rl.losses import LossConfig
from lowrl.sampling import (SampleOutput, SamplingConfig, check_row_local, generate_in_jit,
                            rescore)
from lowrl.sampling.act_scales import used_act_amax
from lowrl.sampling.distributions import sample_token
from lowrl.training import optimizer, rl_update, schema
from lowrl.training.evaluation import eval_metrics
from lowrl.training.rl_update import TokenBatch, UpdateConfig, make_logprob_fn
from lowrl.training.schedule import (LAG_DISTRIBUTIONS, AsyncSchedule, FifoSchedule,
                                    LengthDrivenSchedule, PipelineSchedule)
from lowrl.training.sft import make_sft_step
from lowrl.training.step import BatchConfig, Rollout, Step, make_step

TASK_KINDS = ("sort", "reverse", "copy")
REWARD_KINDS = ("per_token", "exact")
SPLITS = ("train", "eval")
ACT_CALIBRATIONS = ("sync", "base")
# How the consumed version follows the lag (lowrl.training.schedule): fifo = bounded-staleness
# FIFO (never backwards), pipeline = in-flight updates (per-token versions), length = lag from
# the completion length, independent = AsyncSchedule's independent draws (can go backwards).
SCHEDULE_KINDS = ("fifo", "pipeline", "length", "independent")
AUTO = "auto"
# Precision-recipe components the simulator can override on both sides (None = the recipe's).
RECIPE_COMPONENTS = ("act_per_token", "four_over_six", "bf16_last_fraction", "backward")


# ----------------------------------------------------------------------------------------------
# The task.


@dataclasses.dataclass(frozen=True)
class SequenceTask:
  """Transform a random sequence: prompt [bos, x_1..x_L], target f(x) of L tokens.

  Attributes:
    kind: "sort" (ascending), "reverse" or "copy".
    num_symbols: symbols 0..num_symbols-1; the bos id is num_symbols (vocab num_symbols + 1).
    length: L, prompt symbols = completion tokens (the horizon).
    reward: "per_token" (fraction of positions right, in [0, 1]) or "exact" (1 iff all right).
  """

  kind: str = "sort"
  num_symbols: int = 8
  length: int = 6
  reward: str = "per_token"

  def __post_init__(self):
    if self.kind not in TASK_KINDS:
      raise ValueError(f"task.kind={self.kind!r}; use one of {TASK_KINDS}.")
    if self.reward not in REWARD_KINDS:
      raise ValueError(f"task.reward={self.reward!r}; use one of {REWARD_KINDS}.")
    if self.num_symbols < 2 or self.length < 1:
      raise ValueError(f"task needs num_symbols >= 2 and length >= 1, got {self.num_symbols}, "
                       f"{self.length}.")

  @property
  def bos_id(self) -> int:
    return self.num_symbols

  @property
  def vocab_size(self) -> int:
    return self.num_symbols + 1

  def prompts(self, key: jax.Array, n: int, split: str = "train") -> jax.Array:
    """[n, L + 1] int32 prompts (bos first), uniform over the problems of `split`.

    The split is disjoint by construction: a problem is held out ("eval") iff the sum of its
    symbols is 0 mod num_symbols (a property of the multiset, so the permutations of one sort
    problem share a split; about 1 / num_symbols of the problems). Sampling stays uniform on each
    side: the first L - 1 symbols are free, the last is the one value that puts the sum in the
    eval class, or uniform over the num_symbols - 1 values that keep it out.
    """
    if split not in SPLITS:
      raise ValueError(f"split={split!r}; use one of {SPLITS}.")
    k_head, k_last = jax.random.split(key)
    s = self.num_symbols
    head_NL = jax.random.randint(k_head, (n, self.length - 1), 0, s, jnp.int32)
    eval_last_N = (-jnp.sum(head_NL, axis=1)) % s
    if split == "eval":
      last_N = eval_last_N
    else:  # skip the eval value: uniform over the other s - 1 symbols
      offset_N = jax.random.randint(k_last, (n,), 1, s, jnp.int32)
      last_N = (eval_last_N + offset_N) % s
    x_NL = jnp.concatenate([head_NL, last_N[:, None]], axis=1)
    return jnp.concatenate([jnp.full((n, 1), self.bos_id, jnp.int32), x_NL], axis=1)

  def targets(self, prompt_BP: jax.Array) -> jax.Array:
    """[B, L] the reference completion of each prompt."""
    x_BL = prompt_BP[:, 1:]
    if self.kind == "sort":
      return jnp.sort(x_BL, axis=-1)
    if self.kind == "reverse":
      return x_BL[:, ::-1]
    return x_BL

  def rewards(self, prompt_BP: jax.Array, completion_BL: jax.Array
              ) -> tuple[jax.Array, jax.Array]:
    """(reward_B, exact_B), float32: the training reward and the exact-match indicator."""
    right_BL = (completion_BL == self.targets(prompt_BP)).astype(jnp.float32)
    exact_B = jnp.all(right_BL > 0, axis=-1).astype(jnp.float32)
    reward_B = jnp.mean(right_BL, axis=-1) if self.reward == "per_token" else exact_B
    return reward_B, exact_B


# ----------------------------------------------------------------------------------------------
# Config -> static setup.


# One simulator setting: the loop's sections (lowrl.training.schema) with the simulator's defaults
# and only the knobs it implements, plus its own task and recipe knobs.
SCHEMA = schema.Schema((
    schema.Section("", (schema.Knob("seed", 0, "seeds init, prompts, sampling and the eval set"),)),
    schema.Section("task", (
        schema.Knob("kind", "sort", "transform of the prompt's symbols", schema.OneOf(TASK_KINDS)),
        schema.Knob("num_symbols", 8, "alphabet size (>= 2)"),
        schema.Knob("length", 6, "symbols per prompt = completion tokens (the horizon, >= 1)"),
        schema.Knob("reward", "per_token", "per_token (fraction of positions right) | exact (all "
                    "right)", schema.OneOf(REWARD_KINDS)),
    )),
    # Widths are multiples of 16 so every recipe (NVFP4 blocks of 16) can quantize every GEMM.
    schema.MODEL.with_defaults(d_model=32, n_layers=2, n_heads=2, n_kv_heads=1, head_dim=16,
                               d_ff=64),
    schema.Section("", (
        schema.Knob("sampler_recipe", "bf16", "precision recipe of the sampler",
                    schema.OneOf(precision.RECIPES)),
        schema.Knob("trainer_recipe", "bf16", "precision recipe of the trainer",
                    schema.OneOf(precision.RECIPES)),
        schema.Knob("sampler_exact", True, "sampler logprobs from its full forward, as the "
                    "loop's default"),
        # nvfp4_naive scales activations per tensor: the sampler (or greedy eval) then uses
        # static scales, max |input| per matmul over `calib_num_prompts` fixed train prompts +
        # their targets in the trainer's forward, as an inference engine calibrates.
        schema.Knob("act_calibration", "sync", "static activation scales: sync (recalibrated at "
                    "every weight sync, stored in the version ring) or base (once, from the "
                    "starting weights)", schema.OneOf(ACT_CALIBRATIONS)),
        schema.Knob("calib_num_prompts", 64, "prompts (+ targets) of the calibration batch",
                    schema.POSITIVE),
    )),
    schema.SIM_RL.with_defaults(steps=400, num_prompts=8, group_size=8),
    schema.OPTIMIZER.with_defaults(lr=3e-3),
    # Supervised warm start (FP32, inside the same jit): RL starts from a base with a modest
    # reward (docs/reference.md §6).
    schema.SFT.only("steps", "lr", "batch_size").with_defaults(steps=0, batch_size=64),
    # The recipe components, overridable on both sides at once (a sweep knob per component).
    schema.Section("recipe", tuple(
        schema.Knob(k, None, f"None = the recipe's own; else {precision.KNOBS[k]}")
        for k in RECIPE_COMPONENTS)),
    schema.Section("async_rl", (
        schema.Knob("lag", 0, "staleness bound in trainer steps (>= 0; 0 = synchronous), or "
                    "'auto': the cost model's steady-state lag of this setting",
                    factory=lambda: ml_collections.FieldReference(0, field_type=object)),
        schema.Knob("sync_every", 1, "steps between weight syncs to the sampler (>= 1)"),
        schema.Knob("lag_distribution", "fixed", "lag draws (fifo, independent): "
                    + " | ".join(LAG_DISTRIBUTIONS)),
        schema.Knob("schedule", "fifo", "which version each batch (token) is sampled by",
                    schema.OneOf(SCHEDULE_KINDS)),
        schema.Knob("lengths", (), "schedule=length: per-batch longest completions in modelled "
                    "tokens, drawn uniformly; () = (H/4, H/2, 3H/4, H) of the modelled horizon H"),
    ), checks=(lambda prefix, a: _async_check(prefix, a),)),
    # The modelled system whose clock the run keeps (lowrl.asyncrl.timing).
    schema.Section("cost", (
        schema.Knob("hardware", "h100_sxm", "accelerator of both pools",
                    schema.OneOf(tuple(hardware_lib.HARDWARE))),
        schema.Knob("model", "llama3.1_8b", "the real model the tiny decoder stands for",
                    schema.OneOf(tuple(timing.MODEL_SIZES))),
        schema.Knob("sampler_devices", 8, "sampler devices", schema.POSITIVE),
        schema.Knob("trainer_devices", 8, "trainer devices", schema.POSITIVE),
        schema.Knob("sampler_tp", 1, "devices per sampler replica", schema.POSITIVE),
        schema.Knob("mfu", 0.4, "fraction of the dense tensor rate the matmuls reach"),
        schema.Knob("max_in_flight", None, "most batches in flight (None = what memory holds)"),
        schema.Knob("prompt_len", 256, "modelled prompt tokens", schema.POSITIVE),
        schema.Knob("tokens_per_sim_token", 256, "modelled completion tokens per simulated one",
                    schema.POSITIVE),
        schema.Knob("sequences_per_sim_sequence", 4, "modelled sequences per simulated one",
                    schema.POSITIVE),
    )),
    schema.Section("", (schema.EVAL_NUM_PROMPTS,)),
))


def _async_check(prefix: str, a: ml_collections.ConfigDict) -> None:
  """The simulator's async_rl: lag an int >= 0 or 'auto'; the schedule's own checks."""
  if a.lag != AUTO and (not isinstance(a.lag, int) or isinstance(a.lag, bool)):
    raise ValueError(f"--config.{prefix}.lag={a.lag!r}: use an int >= 0 or '{AUTO}'.")
  if a.schedule in ("pipeline", "length") and a.lag_distribution != "fixed":
    raise ValueError(f"--config.{prefix}.schedule={a.schedule} draws no lags; leave "
                     f"--config.{prefix}.lag_distribution=fixed.")
  if a.schedule == "length" and a.lag not in (0, AUTO):
    raise ValueError(f"--config.{prefix}.schedule=length derives the lag from the lengths; "
                     f"set --config.{prefix}.lag={AUTO}.")
  if any(not isinstance(n, int) or n < 1 for n in a.lengths):
    raise ValueError(f"--config.{prefix}.lengths={a.lengths!r}: positive ints (modelled tokens).")
  try:
    AsyncSchedule(lag=0 if a.lag == AUTO else a.lag, sync_every=a.sync_every,
                  lag_distribution=a.lag_distribution)
  except ValueError as e:
    raise ValueError(f"--config.{prefix}.{e}") from None


def default_config() -> ml_collections.ConfigDict:
  """One simulator setting: SCHEMA's defaults (`rl`, `optimizer`, `async_rl` are the loop's)."""
  return SCHEMA.defaults()


def _frozen(c: ml_collections.ConfigDict) -> tuple[tuple[str, Any], ...]:
  return tuple(sorted(c.to_dict().items()))


@dataclasses.dataclass(frozen=True)
class SimSetup:
  """Everything static about a simulated run (hashable: it keys the compile cache)."""

  task: SequenceTask
  model_cfg: ModelConfig
  sampler_policy: precision.PrecisionPolicy
  trainer_policy: precision.PrecisionPolicy
  sampling: SamplingConfig
  update_cfg: UpdateConfig
  optimizer: tuple[tuple[str, Any], ...]
  sft: tuple[tuple[str, Any], ...]
  num_prompts: int
  group_size: int
  steps: int
  advantage: str
  sampler_exact: bool
  eval_num_prompts: int
  std_ddof: int = 0
  act_calibration: str = "sync"
  calib_num_prompts: int = 64
  batch_cfg: BatchConfig | None = None  # rollout -> batch of the RL step (set by `build`)
  pipeline: bool = False  # in-flight weight updates: per-token versions (PipelineSchedule)

  @property
  def batch_size(self) -> int:
    return self.num_prompts * self.group_size

  def make_optimizer(self) -> optax.GradientTransformation:
    total = self.steps * self.update_cfg.mu * self.update_cfg.num_minibatches
    return optimizer.make_optimizer(ml_collections.ConfigDict(dict(self.optimizer)), total)


def build(cfg: ml_collections.ConfigDict) -> SimSetup:
  """Validates a setting (SCHEMA: the loop's rl, optimizer and async_rl checks included, then the
  types built from it) and builds its static pieces; raises ValueError naming the fix."""
  rl = cfg.rl
  SCHEMA.validate(cfg)
  task = SequenceTask(**cfg.task.to_dict())
  model_cfg = ModelConfig(vocab_size=task.vocab_size, max_seq_len=2 * task.length + 1,
                          **cfg.model.to_dict())
  matmuls = layout.matmuls(model_cfg)
  policies = [precision.make_policy(timing.recipe_config(name, cfg.recipe), matmuls)
              for name in (cfg.sampler_recipe, cfg.trainer_recipe)]
  sampling = SamplingConfig(max_new_tokens=task.length, temperature=rl.temperature,
                            top_k=rl.top_k, top_p=rl.top_p, pad_id=task.bos_id)
  sampling.check(model_cfg)
  # Both policies sample (the trainer's in greedy eval), with static scales calibrated for every
  # tensor-scaled path: only activation tiles (2-D blocks) can fail here.
  for policy in policies:
    check_row_local(policy, model_cfg, dict.fromkeys(
        policy.act_paths(matmuls, "tensor"), 0.0))
    quant_blocks.check_quant_blocks(policy, model_cfg, sharding.single_device_plan(),
                                what=f"{policy.name} recipe")
  update_cfg = rl_update.update_config_from(rl, cfg.optimizer.master_rounding,
                                            max_len=task.length)
  return SimSetup(task, model_cfg, policies[0], policies[1], sampling, update_cfg,
                  _frozen(cfg.optimizer), _frozen(cfg.sft), rl.num_prompts, rl.group_size,
                  rl.steps, rl.advantage, cfg.sampler_exact, cfg.eval_num_prompts,
                  std_ddof=rl.std_ddof, act_calibration=cfg.act_calibration,
                  calib_num_prompts=cfg.calib_num_prompts,
                  batch_cfg=BatchConfig.from_rl(rl, task.length),
                  pipeline=cfg.async_rl.schedule == "pipeline")


def lag_of(cfg: ml_collections.ConfigDict) -> int:
  """The setting's lag: `async_rl.lag`, or the cost model's steady-state lag when 'auto' (for
  schedule=length, the longest length's lag)."""
  if cfg.async_rl.schedule == "length":
    return schedule_of(cfg).lag
  if cfg.async_rl.lag == AUTO:
    return timing.clock(cfg).lag
  return cfg.async_rl.lag


def schedule_of(cfg: ml_collections.ConfigDict, seed: int | None = None) -> AsyncSchedule:
  """The setting's schedule (`async_rl.schedule`; lag draws seeded by the run's seed, as in the
  loop). lag='auto' takes the cost model's lag (lowrl.asyncrl.timing); schedule=length turns the
  modelled lengths into lags with the modelled decode tokens per trainer step."""
  a = cfg.async_rl
  seed = cfg.seed if seed is None else seed
  if a.schedule == "length":
    clock = timing.clock(cfg)
    horizon = cfg.task.length * cfg.cost.tokens_per_sim_token
    lengths = tuple(a.lengths) or tuple(max(1, horizon * i // 4) for i in range(1, 5))
    return LengthDrivenSchedule(sync_every=a.sync_every, seed=seed,
                                tokens_per_step=clock.decode_tokens_per_step, lengths=lengths)
  lag = timing.clock(cfg).lag if a.lag == AUTO else a.lag
  kind = {"fifo": FifoSchedule, "pipeline": PipelineSchedule,
          "independent": AsyncSchedule}[a.schedule]
  return kind(lag=lag, sync_every=a.sync_every, lag_distribution=a.lag_distribution, seed=seed)


# ----------------------------------------------------------------------------------------------
# One run.


def _quant_key(policy: precision.PrecisionPolicy, key: jax.Array) -> jax.Array | None:
  return key if policy.needs_key else None


def _generate(setup: SimSetup, policy: precision.PrecisionPolicy, config: SamplingConfig,
              params, prompt_BP: jax.Array, key: jax.Array, quant_key,
              act_amax=None) -> SampleOutput:
  """The sampler's prefill + decode inside the scan (the host-side checks ran in `build`)."""
  return generate_in_jit(params, prompt_BP, jnp.ones(prompt_BP.shape, bool), key,
                         model_cfg=setup.model_cfg, policy=policy, config=config,
                         quant_key=quant_key, act_amax=act_amax)


def calib_key(key: jax.Array) -> jax.Array:
  """The key of a run's calibration prompts (fixed for the run)."""
  return jax.random.fold_in(key, 2**31 - 2)  # outside the range of step indices


def calibrate(setup: SimSetup, policy: precision.PrecisionPolicy, params,
              key: jax.Array) -> dict[str, jax.Array] | None:
  """Static activation amaxes for sampling `params` under `policy` (None if it needs none).

  `calibration.calibrate_act_amax` in the trainer's precision over `calib_num_prompts` train
  prompts from `key` with their target completions.
  """
  paths = policy.act_paths(layout.matmuls(setup.model_cfg), "tensor")
  if not paths:
    return None
  prompt_BP = setup.task.prompts(key, setup.calib_num_prompts)
  tokens_BT = jnp.concatenate([prompt_BP, setup.task.targets(prompt_BP)], axis=1)
  return calibration.calibrate_act_amax(
      params, tokens_BT, setup.model_cfg, setup.trainer_policy, paths,
      quant_key=_quant_key(setup.trainer_policy, key))


def _rollout_keys(key: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
  """(prompt, sampling, quantization) keys of a step's rollout."""
  k_prompt, k_sample, k_quant = jax.random.split(key, 3)
  return k_prompt, k_sample, k_quant


def _train_prompts(setup: SimSetup, k_prompt: jax.Array) -> jax.Array:
  prompt_PL = setup.task.prompts(k_prompt, setup.num_prompts)
  return jnp.repeat(prompt_PL, setup.group_size, axis=0)  # group-contiguous


def sampler_score(setup: SimSetup, out: SampleOutput, params, key: jax.Array,
                  act_amax=None) -> SampleOutput:
  """`out` re-scored by `params` in the sampler's precision (exact mode, `rescore`) with the quant
  key of the rollout keyed by `key`: the sampler's record, or the drift's fourth score."""
  policy = setup.sampler_policy
  return rescore(out, params, model_cfg=setup.model_cfg, policy=policy, config=setup.sampling,
                 quant_key=_quant_key(policy, _rollout_keys(key)[2]), act_amax=act_amax)


def rollout(setup: SimSetup, sampler_params, key: jax.Array, act_amax=None
            ) -> tuple[SampleOutput, jax.Array, jax.Array]:
  """One step's sequences sampled by `sampler_params` in the sampler's precision, with rewards.

  `act_amax`: the static activation scales stored with `sampler_params` (`calibrate`), for a
  sampler recipe that scales activations per tensor. Returns (output, reward_B, exact_B); rows
  are group-contiguous (group_size completions per prompt).
  """
  k_prompt, k_sample, k_quant = _rollout_keys(key)
  prompt_BL = _train_prompts(setup, k_prompt)
  policy = setup.sampler_policy
  out = _generate(setup, policy, setup.sampling, sampler_params, prompt_BL, k_sample,
                  _quant_key(policy, k_quant), act_amax)
  if setup.sampler_exact:
    out = sampler_score(setup, out, sampler_params, key, act_amax)
  reward_B, exact_B = setup.task.rewards(prompt_BL, out.tokens[:, out.prompt_width:])
  return out, reward_B, exact_B


def pipeline_rollout(setup: SimSetup, ring, token_slot_H: jax.Array, key: jax.Array
                     ) -> tuple[SampleOutput, jax.Array, jax.Array]:
  """`rollout` with in-flight weight updates: completion token j is drawn from the ring's version
  in slot token_slot_H[j] (weights and static scales), in the sampler's precision.

  Each token comes from a full forward of the sequence so far under its version (the sampler
  recomputes the prefix with the new weights rather than keeping the old KV cache), so the recorded
  log q is exactly the distribution the token was drawn from (exact mode by construction).
  """
  k_prompt, k_sample, k_quant = _rollout_keys(key)
  prompt_BP = _train_prompts(setup, k_prompt)
  policy, cfg = setup.sampler_policy, setup.sampling
  b, p = prompt_BP.shape
  h = setup.task.length
  tokens_BT = jnp.concatenate([prompt_BP, jnp.full((b, h), cfg.pad_id, jnp.int32)], axis=1)
  qk = _quant_key(policy, k_quant)

  def draw(tokens_BT, j):
    params, act_amax = jax.tree.map(lambda r: r[token_slot_H[j]], ring)
    # Causal: the pad columns after position p + j - 1 do not reach its logits.
    logits_BTV = transformer.forward(params, tokens_BT, setup.model_cfg, policy,
                                     mask_BT=jnp.ones(tokens_BT.shape, jnp.float32),
                                     quant_key=qk,
                                     act_amax=used_act_amax(policy, setup.model_cfg, act_amax))
    logits_BV = jax.lax.dynamic_index_in_dim(logits_BTV, p + j - 1, axis=1, keepdims=False)
    tok_B, logq_B, logp_B = sample_token(jax.random.fold_in(k_sample, j),
                                         logits_BV.astype(jnp.float32), cfg)
    return tokens_BT.at[:, p + j].set(tok_B), (logq_B, logp_B)

  tokens_BT, (logq_HB, logp_HB) = jax.lax.scan(draw, tokens_BT, jnp.arange(h))
  pad = ((0, 0), (p, 0))
  out = SampleOutput(
      tokens=tokens_BT, prompt_mask=jnp.pad(jnp.ones((b, p), jnp.float32), ((0, 0), (0, h))),
      completion_mask=jnp.pad(jnp.ones((b, h), jnp.float32), pad),
      logprobs=jnp.pad(logq_HB.T, pad), model_logprobs=jnp.pad(logp_HB.T, pad),
      prompt_lengths=jnp.full((b,), p, jnp.int32), completion_lengths=jnp.full((b,), h, jnp.int32),
      prompt_width=p)
  reward_B, exact_B = setup.task.rewards(prompt_BP, tokens_BT[:, p:])
  return out, reward_B, exact_B


def evaluate(setup: SimSetup, params, key: jax.Array) -> dict[str, jax.Array]:
  """Greedy reward and exact-match rate of the trainer's policy (trainer precision) on held-out
  prompts (the eval split: problems never drawn for training); `evaluation.eval_metrics`."""
  prompt_BP = setup.task.prompts(key, setup.eval_num_prompts, "eval")
  greedy = dataclasses.replace(setup.sampling, temperature=0.0, top_k=0, top_p=1.0)
  # A trainer recipe with per-tensor activation scales decodes as deployed: static scales
  # calibrated from the evaluated weights.
  act_amax = calibrate(setup, setup.trainer_policy, params, calib_key(key))
  out = _generate(setup, setup.trainer_policy, greedy, params, prompt_BP, key,
                  _quant_key(setup.trainer_policy, key), act_amax)
  reward_B, _ = setup.task.rewards(prompt_BP, out.tokens[:, out.prompt_width:])
  # Solved = reward 1 = every position right: the exact match under either reward kind.
  m = eval_metrics(reward_B)
  return {"reward": m["greedy_reward"], "exact": m["greedy"]}


def warm_start(setup: SimSetup, key: jax.Array):
  """Random init, then `sft.steps` supervised steps on the targets: the loop's SFT step (FP32)
  with this simulator's optimizer (Adam, constant lr, b2 0.99, gradients clipped at norm 1)."""
  params = init.init_params(setup.model_cfg, key)
  sft = dict(setup.sft)
  if not sft["steps"]:
    return params
  tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adam(sft["lr"], b2=0.99))
  sft_step = make_sft_step(setup.model_cfg, tx)
  length = setup.task.length
  mask_T = jnp.concatenate([jnp.zeros(length + 1), jnp.ones(length)])

  def step(carry, k):
    prompt_BP = setup.task.prompts(k, sft["batch_size"])
    tokens_BT = jnp.concatenate([prompt_BP, setup.task.targets(prompt_BP)], axis=1)
    mask_BT = jnp.broadcast_to(mask_T, tokens_BT.shape)
    p, o, loss = sft_step(*carry, tokens_BT, mask_BT)
    return (p, o), loss

  keys = jax.random.split(jax.random.fold_in(key, 1), sft["steps"])
  (params, _), _ = jax.lax.scan(step, (params, tx.init(params)), keys)
  return params


def initial_params(setup: SimSetup, key: jax.Array):
  """The run's starting policy (warm start), in the master-weight dtype."""
  k_init, _ = jax.random.split(key)
  return optimizer.to_master(warm_start(setup, k_init), dict(setup.optimizer)["master_dtype"])


def make_rl_step(setup: SimSetup) -> tuple[Step, Any]:
  """(the loop's RL step `lowrl.training.step.make_step` for this setup, the trainer's
  `logprob_fn` that scores the rollouts)."""
  logprob_fn = make_logprob_fn(setup.model_cfg, setup.trainer_policy, setup.sampling)
  return make_step(logprob_fn, setup.make_optimizer(), setup.update_cfg,
                   setup.batch_cfg), logprob_fn


def sampler_scores_are_trainers(setup: SimSetup) -> bool:
  """Whether the sampler's precision scores any weights exactly as the trainer's does, so the
  drift's fourth score (current weights in the sampler's precision) is the trainer's own.

  Identical recipes, unless the sampler runs on static activation scales (per-tensor recipes,
  as deployed) while the trainer takes each batch's own: then the scale difference is a
  quantization drift, and taking the trainer's score as the fourth would count half of it as
  staleness.
  """
  return (setup.sampler_policy == setup.trainer_policy and not
          setup.sampler_policy.act_paths(layout.matmuls(setup.model_cfg), "tensor"))


def make_train(setup: SimSetup, num_slots: int) -> Callable[..., tuple[Any, dict[str, jax.Array]]]:
  """`train(params, key, plan) -> (final params, metrics)`: all the updates of a run, one scan.

  `plan` is `AsyncSchedule.ring_plan(setup.steps, num_slots)` (as arrays; a pipeline setup adds
  `token_read_slot` [steps, horizon] of `PipelineSchedule.token_ring_plan`); `metrics` are
  [steps] arrays of per-step scalars. Pure and jittable. With rl.kl_coef > 0 the KL penalty is
  to the starting params (the loop's reference: its base).
  """
  tx = setup.make_optimizer()
  rl_step, logprob_fn = make_rl_step(setup)
  use_ref = setup.update_cfg.loss.kl_coef > 0
  same_precision = sampler_scores_are_trainers(setup)
  p_width = setup.task.length + 1

  def train(params, key, plan):
    _, k_steps = jax.random.split(key)
    opt_state = optimizer.init_opt_state(tx, params)
    ref_params = params if use_ref else None
    k_calib = calib_key(key)
    base_amax = calibrate(setup, setup.sampler_policy, params, k_calib)

    def rollout_weights(p):
      """What a sync ships to the samplers: the weights and their static activation scales."""
      if setup.act_calibration == "sync":
        return p, calibrate(setup, setup.sampler_policy, p, k_calib)
      return p, base_amax

    ring = jax.tree.map(lambda p: jnp.zeros((num_slots,) + p.shape, p.dtype),
                        rollout_weights(params))
    ring_version = jnp.full((num_slots,), -1, jnp.int32)

    def step(carry, xs):
      params, opt_state, ring, ring_version = carry
      t, write, write_slot, read_slot, token_slot_H = xs
      # Sync: version t (params after t updates) reaches the samplers' slot.
      ring = jax.tree.map(
          lambda r, p: r.at[write_slot].set(jnp.where(write, p, r[write_slot])), ring,
          rollout_weights(params))
      ring_version = ring_version.at[write_slot].set(
          jnp.where(write, t, ring_version[write_slot]))
      sampler_params, sampler_amax = jax.tree.map(lambda r: r[read_slot], ring)
      k_roll, k_score, k_upd = jax.random.split(jax.random.fold_in(k_steps, t), 3)
      # The trainer's scores share one key, so with lag 0 the staleness part is exactly 0.
      qk = _quant_key(setup.trainer_policy, k_score)
      if setup.pipeline:
        out, reward_B, exact_B = pipeline_rollout(setup, ring, token_slot_H, k_roll)
        tokens = TokenBatch(out.tokens, out.attention_mask)
        # Stale score per token: the trainer's score under every slot, each token's slot picked.
        logp_SBT = jax.lax.map(lambda slot_params: logprob_fn(slot_params, tokens, qk)[0],
                               ring[0])
        slot_T = jnp.concatenate([jnp.zeros((p_width,), jnp.int32), token_slot_H])
        logp_stale_BT = jnp.take_along_axis(logp_SBT, slot_T[None, None, :], axis=0)[0]
      else:
        out, reward_B, exact_B = rollout(setup, sampler_params, k_roll, sampler_amax)
        tokens = TokenBatch(out.tokens, out.attention_mask)
        logp_stale_BT = logprob_fn(sampler_params, tokens, qk)[0]
      logp_now_BT = logprob_fn(params, tokens, qk)[0]
      if same_precision:
        logp_now_sampler_BT = logp_now_BT
      else:  # the static scales a sync of the current weights would ship
        logp_now_sampler_BT = sampler_score(setup, out, params, k_roll,
                                            rollout_weights(params)[1]).logprobs
      params_before = params
      params, opt_state, m = rl_step(
          params, opt_state, ref_params,
          Rollout(out, reward_B, logp_now_BT, logp_stale_BT, logp_now_sampler_BT), k_upd)
      version = ring_version[read_slot]
      m = {**m, "reward/exact": jnp.mean(exact_B), "sampler_version": version,
           "drift/tokens": jnp.sum(out.completion_mask),
           "drift/staleness/version_distance": version_distance(sampler_params, params_before),
           "sampler_version_lag": t - version}
      return (params, opt_state, ring, ring_version), m

    token_slot = plan.get("token_read_slot",
                          jnp.zeros((setup.steps, setup.task.length), jnp.int32))
    xs = (jnp.arange(setup.steps, dtype=jnp.int32), plan["write"], plan["write_slot"],
          plan["read_slot"], token_slot)
    (params, *_), metrics = jax.lax.scan(step, (params, opt_state, ring, ring_version), xs)
    return params, metrics

  return train


def eval_key(key: jax.Array) -> jax.Array:
  """The key of a run's held-out prompts (the same before and after training)."""
  return jax.random.fold_in(key, 2**31 - 1)  # outside the range of step indices


@dataclasses.dataclass(frozen=True)
class SimResult:
  """One setting's runs. `metrics`: numpy [S, steps] per-step scalars and [S] eval scalars."""

  params: Any  # final params, stacked over seeds
  metrics: dict[str, np.ndarray]
  compile_s: float  # 0 when the programs were already compiled
  run_s: float

  @property
  def updates_per_minute(self) -> float:
    seeds, steps = self.metrics["reward/mean"].shape
    return 60.0 * seeds * steps / max(self.run_s, 1e-9)


def _specs(setup: SimSetup, num_seeds: int):
  keys = jax.eval_shape(lambda: jax.random.split(jax.random.key(0), num_seeds))
  params = jax.eval_shape(jax.vmap(functools.partial(initial_params, setup)), keys)
  return keys, params


def _eval_view(setup: SimSetup) -> SimSetup:
  """The setup with the fields initial_params and evaluate do not read made canonical, so that
  settings differing only there share those compiled programs."""
  return dataclasses.replace(setup, sampler_policy=setup.trainer_policy,
                             update_cfg=UpdateConfig(LossConfig(), CorrectionConfig()), steps=1,
                             num_prompts=1, group_size=2, advantage="grpo", sampler_exact=False,
                             std_ddof=0, batch_cfg=None)


@functools.lru_cache(maxsize=32)
def _init_eval(setup: SimSetup, num_seeds: int) -> tuple[Any, Any, float]:
  """Compiled (vmapped) initial_params and evaluate, and how long compiling took."""
  t0 = time.perf_counter()
  keys, params = _specs(setup, num_seeds)
  init = jax.jit(jax.vmap(functools.partial(initial_params, setup))).lower(keys).compile()
  ev = jax.jit(jax.vmap(lambda p, k: evaluate(setup, p, eval_key(k)))).lower(params, keys)
  return init, ev.compile(), time.perf_counter() - t0


@functools.lru_cache(maxsize=32)
def _train(setup: SimSetup, num_slots: int, num_seeds: int) -> tuple[Any, float]:
  """The compiled (vmapped) training scan, and how long compiling took."""
  t0 = time.perf_counter()
  keys, params = _specs(setup, num_seeds)
  plan = {"write": jax.ShapeDtypeStruct((num_seeds, setup.steps), jnp.bool_),
          "write_slot": jax.ShapeDtypeStruct((num_seeds, setup.steps), jnp.int32),
          "read_slot": jax.ShapeDtypeStruct((num_seeds, setup.steps), jnp.int32)}
  if setup.pipeline:
    plan["token_read_slot"] = jax.ShapeDtypeStruct((num_seeds, setup.steps, setup.task.length),
                                                   jnp.int32)
  train = jax.jit(jax.vmap(make_train(setup, num_slots))).lower(params, keys, plan).compile()
  return train, time.perf_counter() - t0


def simulate(setup: SimSetup, schedule: AsyncSchedule, seeds: Sequence[int],
             num_slots: int | None = None) -> SimResult:
  """Runs one setting for every seed (vmapped; one compiled program per (setup, slots, seeds)).

  Seed s runs from `jax.random.key(s)` with `schedule` re-seeded by s (its lag draws). A fixed
  `num_slots` >= every schedule's `max_versions` lets settings that differ only in lag or sync
  interval share one compiled program; the results do not depend on it.
  """
  if not seeds:
    raise ValueError("simulate needs at least one seed.")
  if setup.pipeline != isinstance(schedule, PipelineSchedule):
    raise ValueError("a setup built with async_rl.schedule=pipeline runs a PipelineSchedule, and "
                     "only it.")
  num_slots = schedule.max_versions if num_slots is None else num_slots
  keys_of_plan = ("write", "write_slot", "read_slot")
  if setup.pipeline:
    plans = [dataclasses.replace(schedule, seed=int(s)).token_ring_plan(
        setup.steps, setup.task.length, num_slots) for s in seeds]
    keys_of_plan += ("token_read_slot",)
  else:
    plans = [dataclasses.replace(schedule, seed=int(s)).ring_plan(setup.steps, num_slots)
             for s in seeds]
  plan = {k: jnp.asarray(np.stack([p[k] for p in plans])) for k in keys_of_plan}
  keys = jnp.stack([jax.random.key(int(s)) for s in seeds])
  compile_s = 0.0
  misses = _init_eval.cache_info().misses
  init, ev, seconds = _init_eval(_eval_view(setup), len(seeds))
  compile_s += seconds if _init_eval.cache_info().misses > misses else 0.0
  misses = _train.cache_info().misses
  train, seconds = _train(setup, num_slots, len(seeds))
  compile_s += seconds if _train.cache_info().misses > misses else 0.0
  t0 = time.perf_counter()
  params = init(keys)
  ev_start = ev(params, keys)
  params, metrics = train(params, keys, plan)
  ev_end = ev(params, keys)
  metrics.update({f"eval/start/{k}": v for k, v in ev_start.items()})
  metrics.update({f"eval/end/{k}": v for k, v in ev_end.items()})
  metrics = {k: np.asarray(v) for k, v in metrics.items()}  # waits for the device
  return SimResult(params, metrics, compile_s, time.perf_counter() - t0)
