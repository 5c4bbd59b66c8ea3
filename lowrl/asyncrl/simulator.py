"""A fast asynchronous-RL simulator: all the policy updates of a run are one jitted `lax.scan`.

The pieces are the real loop's (lowrl.training.loop), called from inside the scan: the decoder
(`lowrl.models.transformer`) under the sampler's and the trainer's precision policies
(`lowrl.precision`, quantized through `lowrl.quant`), the sampler's prefill + decode
(`lowrl.sampling`, exact mode re-scoring included), group advantages, the pure RL update
`make_rl_update` (losses, TIS/MIS corrections, optimizer), the drift decomposition
(`lowrl.rl.drift`) and the staleness schedule (`AsyncSchedule`). What is small is the rest:
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
  3. reward in JAX, group-relative advantages;
  4. drift: the batch re-scored by the trainer with the sampler's (stale) weights and with the
     current weights -> quantization / staleness / total parts;
  5. the pure update (pi_old recompute, correction, mu x num_minibatches optimizer steps).
Every step's scalar metrics come back as [steps] arrays.
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

from lowrl import precision, sharding
from lowrl.rl.drift import sampler_trainer_drift, version_distance
from lowrl.training.schedule import AsyncSchedule
from lowrl.models import layout, transformer
from lowrl.models.config import ModelConfig
from lowrl.rl.advantages import compute_advantages
from lowrl.rl.corrections import CorrectionConfig
from lowrl.rl.losses import LossConfig
from lowrl import sampling as sampler
from lowrl.training import optimizer, rl_update
from lowrl.training.rl_update import UpdateConfig, make_logprob_fn, make_rl_update
from lowrl.training.sft import sft_loss

TASK_KINDS = ("sort", "reverse", "copy")
REWARD_KINDS = ("per_token", "exact")
SPLITS = ("train", "eval")
ACT_CALIBRATIONS = ("sync", "base")


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


def default_config() -> ml_collections.ConfigDict:
  """One simulator setting. `rl`, `optimizer` and `async_rl` use configs/base.py's names."""
  c = ml_collections.ConfigDict()
  c.seed = 0
  c.task = ml_collections.ConfigDict()
  c.task.kind = "sort"  # sort | reverse | copy the prompt's symbols
  c.task.num_symbols = 8  # alphabet size
  c.task.length = 6  # symbols per prompt = completion tokens (the horizon)
  c.task.reward = "per_token"  # per_token (fraction of positions right) | exact (all right)
  # Widths are multiples of 16 so every recipe (NVFP4 blocks of 16) can quantize every GEMM.
  c.model = ml_collections.ConfigDict(
      {"d_model": 32, "n_layers": 2, "n_heads": 2, "n_kv_heads": 1, "head_dim": 16, "d_ff": 64,
       "tie_embeddings": True})
  c.sampler_recipe = "bf16"  # precision recipe of the sampler (lowrl.precision.RECIPES)
  c.trainer_recipe = "bf16"  # precision recipe of the trainer
  c.sampler_exact = True  # sampler logprobs from its full forward, as the loop's default
  # Static activation scales of a sampler (or greedy eval) whose recipe scales activations per
  # tensor (nvfp4_naive): max |input| per matmul over `calib_num_prompts` fixed train prompts +
  # their targets, in the trainer's forward, as an inference engine calibrates. "sync":
  # recalibrated from the weights at every weight sync (stored with them in the version ring);
  # "base": once, from the run's starting weights.
  c.act_calibration = "sync"
  c.calib_num_prompts = 64  # prompts (+ targets) of the calibration batch

  c.rl = rl_update.default_rl_config()  # the loop's knobs and defaults
  c.rl.steps = 400
  c.rl.num_prompts = 8
  c.rl.group_size = 8

  c.optimizer = optimizer.default_optimizer_config()
  c.optimizer.lr = 3e-3

  # Supervised warm start (FP32, inside the same jit): RL starts from a base with a modest
  # reward (REFERENCE.md §5). 0 = RL from the random init.
  c.sft = ml_collections.ConfigDict({"steps": 0, "lr": 3e-3, "batch_size": 64})

  c.async_rl = ml_collections.ConfigDict({"lag": 0, "sync_every": 1, "lag_distribution": "fixed"})
  c.eval_num_prompts = 256
  return c


def _frozen(c: ml_collections.ConfigDict) -> tuple[tuple[str, Any], ...]:
  return tuple(sorted(c.to_dict().items()))


@dataclasses.dataclass(frozen=True)
class SimSetup:
  """Everything static about a simulated run (hashable: it keys the compile cache)."""

  task: SequenceTask
  model_cfg: ModelConfig
  sampler_policy: precision.PrecisionPolicy
  trainer_policy: precision.PrecisionPolicy
  sampling: sampler.SamplingConfig
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

  @property
  def batch_size(self) -> int:
    return self.num_prompts * self.group_size

  def make_optimizer(self) -> optax.GradientTransformation:
    total = self.steps * self.update_cfg.mu * self.update_cfg.num_minibatches
    return optimizer.make_optimizer(ml_collections.ConfigDict(dict(self.optimizer)), total)


def build(cfg: ml_collections.ConfigDict) -> SimSetup:
  """Validates a setting and builds its static pieces; raises ValueError naming the fix."""
  rl = cfg.rl
  optimizer.validate_optimizer_config(cfg.optimizer)
  task = SequenceTask(**cfg.task.to_dict())
  model_cfg = ModelConfig(vocab_size=task.vocab_size, max_seq_len=2 * task.length + 1,
                          **cfg.model.to_dict())
  matmuls = layout.matmuls(model_cfg)
  policies = [precision.make_policy(precision.recipe(name), matmuls)
              for name in (cfg.sampler_recipe, cfg.trainer_recipe)]
  sampling = sampler.SamplingConfig(max_new_tokens=task.length, temperature=1.0,
                                    pad_id=task.bos_id)
  sampling.check(model_cfg)
  if cfg.act_calibration not in ACT_CALIBRATIONS:
    raise ValueError(f"act_calibration={cfg.act_calibration!r}; use one of {ACT_CALIBRATIONS}.")
  if cfg.calib_num_prompts < 1:
    raise ValueError(f"calib_num_prompts={cfg.calib_num_prompts} must be >= 1.")
  # Both policies sample (the trainer's in greedy eval), with static scales calibrated for every
  # tensor-scaled path: only activation tiles (2-D blocks) can fail here.
  for policy in policies:
    sampler.check_row_local(policy, model_cfg, dict.fromkeys(
        policy.act_paths(matmuls, "tensor"), 0.0))
    sharding.check_quant_blocks(policy, model_cfg, sharding.single_device_plan(),
                                what=f"{policy.name} recipe")
  update_cfg = rl_update.update_config_from(rl, cfg.optimizer.master_rounding,
                                            max_len=task.length)
  return SimSetup(task, model_cfg, policies[0], policies[1], sampling, update_cfg,
                  _frozen(cfg.optimizer), _frozen(cfg.sft), rl.num_prompts, rl.group_size,
                  rl.steps, rl.advantage, cfg.sampler_exact, cfg.eval_num_prompts,
                  std_ddof=rl.std_ddof, act_calibration=cfg.act_calibration,
                  calib_num_prompts=cfg.calib_num_prompts)


def schedule_of(cfg: ml_collections.ConfigDict, seed: int | None = None) -> AsyncSchedule:
  """The setting's AsyncSchedule (lag draws seeded by the run's seed, as in the loop)."""
  a = cfg.async_rl
  return AsyncSchedule(lag=a.lag, sync_every=a.sync_every, lag_distribution=a.lag_distribution,
                       seed=cfg.seed if seed is None else seed)


# ----------------------------------------------------------------------------------------------
# One run.


def _quant_key(policy: precision.PrecisionPolicy, key: jax.Array) -> jax.Array | None:
  return key if policy.needs_key else None


def _generate(setup: SimSetup, policy: precision.PrecisionPolicy, config: sampler.SamplingConfig,
              params, prompt_BP: jax.Array, key: jax.Array, quant_key,
              act_amax=None) -> sampler.SampleOutput:
  """The sampler's prefill + decode inside the scan (the host-side checks ran in `build`)."""
  return sampler.generate_in_jit(params, prompt_BP, jnp.ones(prompt_BP.shape, bool), key,
                                 model_cfg=setup.model_cfg, policy=policy, config=config,
                                 quant_key=quant_key, act_amax=act_amax)


def calib_key(key: jax.Array) -> jax.Array:
  """The key of a run's calibration prompts (fixed for the run)."""
  return jax.random.fold_in(key, 2**31 - 2)  # outside the range of step indices


def calibrate(setup: SimSetup, policy: precision.PrecisionPolicy, params,
              key: jax.Array) -> dict[str, jax.Array] | None:
  """Static activation amaxes for sampling `params` under `policy` (None if it needs none).

  `transformer.calibrate_act_amax` in the trainer's precision over `calib_num_prompts` train
  prompts from `key` with their target completions.
  """
  paths = policy.act_paths(layout.matmuls(setup.model_cfg), "tensor")
  if not paths:
    return None
  prompt_BP = setup.task.prompts(key, setup.calib_num_prompts)
  tokens_BT = jnp.concatenate([prompt_BP, setup.task.targets(prompt_BP)], axis=1)
  return transformer.calibrate_act_amax(
      params, tokens_BT, setup.model_cfg, setup.trainer_policy, paths,
      quant_key=_quant_key(setup.trainer_policy, key))


def rollout(setup: SimSetup, sampler_params, key: jax.Array, act_amax=None
            ) -> tuple[dict[str, jax.Array], dict[str, jax.Array]]:
  """One step's batch sampled by `sampler_params` in the sampler's precision, with rewards.

  `act_amax`: the static activation scales stored with `sampler_params` (`calibrate`), for a
  sampler recipe that scales activations per tensor. Returns (batch for the update,
  {"reward_B", "exact_B"}).
  """
  k_prompt, k_sample, k_quant = jax.random.split(key, 3)
  prompt_PL = setup.task.prompts(k_prompt, setup.num_prompts)
  prompt_BL = jnp.repeat(prompt_PL, setup.group_size, axis=0)  # group-contiguous
  policy = setup.sampler_policy
  out = _generate(setup, policy, setup.sampling, sampler_params, prompt_BL, k_sample,
                  _quant_key(policy, k_quant), act_amax)
  if setup.sampler_exact:
    out = sampler.rescore(out, sampler_params, model_cfg=setup.model_cfg, policy=policy,
                          config=setup.sampling, quant_key=_quant_key(policy, k_quant),
                          act_amax=act_amax)
  reward_B, exact_B = setup.task.rewards(prompt_BL, out.tokens[:, out.prompt_width:])
  # log q of the sampled distribution, as the loop (identical to model_logprobs at temperature 1).
  batch = {"tokens_BT": out.tokens, "input_mask_BT": out.attention_mask,
           "loss_mask_BT": out.completion_mask, "logp_sampler_BT": out.logprobs,
           "adv_B": compute_advantages(reward_B, setup.group_size, setup.advantage,
                                       std_ddof=setup.std_ddof)}
  return batch, {"reward_B": reward_B, "exact_B": exact_B}


def evaluate(setup: SimSetup, params, key: jax.Array) -> dict[str, jax.Array]:
  """Greedy reward of the trainer's policy (trainer precision) on held-out prompts (the eval
  split: problems never drawn for training)."""
  prompt_BP = setup.task.prompts(key, setup.eval_num_prompts, "eval")
  greedy = dataclasses.replace(setup.sampling, temperature=0.0)
  # A trainer recipe with per-tensor activation scales decodes as deployed: static scales
  # calibrated from the evaluated weights.
  act_amax = calibrate(setup, setup.trainer_policy, params, calib_key(key))
  out = _generate(setup, setup.trainer_policy, greedy, params, prompt_BP, key,
                  _quant_key(setup.trainer_policy, key), act_amax)
  reward_B, exact_B = setup.task.rewards(prompt_BP, out.tokens[:, out.prompt_width:])
  return {"reward": jnp.mean(reward_B), "exact": jnp.mean(exact_B)}


def warm_start(setup: SimSetup, key: jax.Array):
  """Random init, then `sft.steps` supervised steps on the targets (FP32, like the loop's base)."""
  params = transformer.init_params(setup.model_cfg, key)
  sft = dict(setup.sft)
  if not sft["steps"]:
    return params
  policy = precision.PrecisionPolicy.unquantized(layout.matmuls(setup.model_cfg), "float32",
                                                 name="sft_fp32")
  tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adam(sft["lr"], b2=0.99))
  length = setup.task.length
  mask_T = jnp.concatenate([jnp.zeros(length + 1), jnp.ones(length)])

  def step(carry, k):
    p, o = carry
    prompt_BP = setup.task.prompts(k, sft["batch_size"])
    tokens_BT = jnp.concatenate([prompt_BP, setup.task.targets(prompt_BP)], axis=1)
    mask_BT = jnp.broadcast_to(mask_T, tokens_BT.shape)
    loss, grads = jax.value_and_grad(sft_loss)(p, tokens_BT, mask_BT, setup.model_cfg, policy)
    updates, o = tx.update(grads, o, p)
    return (optax.apply_updates(p, updates), o), loss

  keys = jax.random.split(jax.random.fold_in(key, 1), sft["steps"])
  (params, _), _ = jax.lax.scan(step, (params, tx.init(params)), keys)
  return params


def initial_params(setup: SimSetup, key: jax.Array):
  """The run's starting policy (warm start), in the master-weight dtype."""
  k_init, _ = jax.random.split(key)
  return optimizer.to_master(warm_start(setup, k_init), dict(setup.optimizer)["master_dtype"])


def make_train(setup: SimSetup, num_slots: int) -> Callable[..., tuple[Any, dict[str, jax.Array]]]:
  """`train(params, key, plan) -> (final params, metrics)`: all the updates of a run, one scan.

  `plan` is `AsyncSchedule.ring_plan(setup.steps, num_slots)` (as arrays); `metrics` are
  [steps] arrays of per-step scalars. Pure and jittable.
  """
  tx = setup.make_optimizer()
  logprob_fn = make_logprob_fn(setup.model_cfg, setup.trainer_policy)
  update = make_rl_update(logprob_fn, tx, setup.update_cfg)

  def train(params, key, plan):
    _, k_steps = jax.random.split(key)
    opt_state = optimizer.init_opt_state(tx, params)
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
      t, write, write_slot, read_slot = xs
      # Sync: version t (params after t updates) reaches the samplers' slot.
      ring = jax.tree.map(
          lambda r, p: r.at[write_slot].set(jnp.where(write, p, r[write_slot])), ring,
          rollout_weights(params))
      ring_version = ring_version.at[write_slot].set(
          jnp.where(write, t, ring_version[write_slot]))
      sampler_params, sampler_amax = jax.tree.map(lambda r: r[read_slot], ring)
      k_roll, k_drift, k_upd = jax.random.split(jax.random.fold_in(k_steps, t), 3)
      batch, info = rollout(setup, sampler_params, k_roll, sampler_amax)
      drift = sampler_trainer_drift(logprob_fn, sampler_params, params, batch,
                                    batch["logp_sampler_BT"], batch["loss_mask_BT"],
                                    _quant_key(setup.trainer_policy, k_drift))
      params_before = params
      params, opt_state, m = update(params, opt_state, None, batch, k_upd)
      version = ring_version[read_slot]
      m = {**m, **drift, "reward/mean": jnp.mean(info["reward_B"]),
           "reward/exact": jnp.mean(info["exact_B"]), "sampler_version": version,
           "drift/tokens": jnp.sum(batch["loss_mask_BT"]),
           "drift/staleness/version_distance": version_distance(sampler_params, params_before),
           "sampler_version_lag": t - version}
      return (params, opt_state, ring, ring_version), m

    xs = (jnp.arange(setup.steps, dtype=jnp.int32), plan["write"], plan["write_slot"],
          plan["read_slot"])
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
                             std_ddof=0)


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
  num_slots = schedule.max_versions if num_slots is None else num_slots
  plans = [dataclasses.replace(schedule, seed=int(s)).ring_plan(setup.steps, num_slots)
           for s in seeds]
  plan = {k: jnp.asarray(np.stack([p[k] for p in plans]))
          for k in ("write", "write_slot", "read_slot")}
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
