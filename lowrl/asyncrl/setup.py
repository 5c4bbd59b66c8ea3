"""One simulator setting: its config schema (`SCHEMA`), and `build(cfg) -> SimSetup`, the static
pieces of a run (hashable: they key the compile cache), plus the setting's lag and schedule.
"""
from __future__ import annotations

import dataclasses
from typing import Any

import ml_collections
import optax

from lowrl import hardware as hardware_lib, quant_blocks
from lowrl import precision, sharding
from lowrl.asyncrl import timing
from lowrl.asyncrl.task import REWARD_KINDS, TASK_KINDS, SequenceTask
from lowrl.models import layout, routing
from lowrl.models.config import ModelConfig
from lowrl.sampling import SamplingConfig, check_row_local
from lowrl.training import optimizer, rl_update, schema
from lowrl.training.rl_update import UpdateConfig
from lowrl.training.schedule import (LAG_DISTRIBUTIONS, AsyncSchedule, FifoSchedule,
                                    LengthDrivenSchedule, PipelineSchedule)
from lowrl.training.step import BatchConfig

ACT_CALIBRATIONS = ("sync", "base")
# How the consumed version follows the lag (lowrl.training.schedule): fifo = bounded-staleness
# FIFO (never backwards), pipeline = in-flight updates (per-token versions), length = lag from
# the completion length, independent = AsyncSchedule's independent draws (can go backwards).
SCHEDULE_KINDS = ("fifo", "pipeline", "length", "independent")
AUTO = "auto"
# Precision-recipe components the simulator can override on both sides (None = the recipe's).
RECIPE_COMPONENTS = ("act_per_token", "four_over_six", "bf16_last_fraction", "backward")



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
        # MoE models (model.n_experts > 0): the rollout records the sampler's routing and the
        # step logs routing/flips (lowrl.asyncrl.scan); this knob replays it in the update.
        schema.Knob("routing_replay", False, "MoE routing replay (R3), as the loop's "
                    "rl.routing_replay: the trainer's forwards (pi_old, the stale score, the "
                    "update) send each token to the experts the sampler chose"),
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
    schema.Section("", (
        schema.EVAL_NUM_PROMPTS,
        schema.Knob("eval_every", 0, "steps between greedy held-out evals of the trainer's policy "
                    "inside the scan (the eval curve, for time to target; 0 = start and end only)",
                    schema.AtLeast(0)),
    )),
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
  eval_every: int = 0  # greedy held-out eval of the trainer's policy every this many steps
  routing_replay: bool = False  # MoE: the trainer replays the sampler's recorded routing
  # Sampled held-out eval (scan.sampled_correct) every this many steps (0 = off), with this many
  # completions per prompt; set by callers (experiments/kl_reset.py), not a SCHEMA knob.
  pass_eval_every: int = 0
  pass_eval_samples: int = 0

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
  if model_cfg.is_moe and cfg.async_rl.schedule == "pipeline":
    raise ValueError("--config.async_rl.schedule=pipeline records no MoE routing; use another "
                     "schedule (or model.n_experts=0).")
  if cfg.routing_replay:
    try:
      routing.check_replay(model_cfg)
    except ValueError as e:
      raise ValueError(f"--config.routing_replay: {e}") from None
  update_cfg = rl_update.update_config_from(rl, cfg.optimizer.master_rounding,
                                            max_len=task.length)
  return SimSetup(task, model_cfg, policies[0], policies[1], sampling, update_cfg,
                  _frozen(cfg.optimizer), _frozen(cfg.sft), rl.num_prompts, rl.group_size,
                  rl.steps, rl.advantage, cfg.sampler_exact, cfg.eval_num_prompts,
                  std_ddof=rl.std_ddof, act_calibration=cfg.act_calibration,
                  calib_num_prompts=cfg.calib_num_prompts,
                  batch_cfg=BatchConfig.from_rl(rl, task.length),
                  pipeline=cfg.async_rl.schedule == "pipeline", eval_every=cfg.eval_every,
                  routing_replay=bool(cfg.routing_replay))


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
