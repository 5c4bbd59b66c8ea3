"""The config schema: every knob of a run once, with its default, its check and its meaning.

A `Section` is a table of `Knob`s (name, default, check, one-line meaning) plus the checks that
relate several of its knobs; a `Schema` is the ordered sections of one run kind. Two run kinds use
them: the training loop (`TRAIN`, whose defaults are configs/base.py; `loop.build` validates it)
and the simulator (`lowrl.asyncrl.simulator.SCHEMA`, the shared sections plus its own;
`simulator.build` validates it). `Schema.defaults()` builds the ConfigDict, `Schema.validate(cfg)`
raises a one-line ValueError naming the `--config.*` flag and the fix, and `Schema.docs()` gives
the meanings `--print_config` shows.

What the schema checks: choices (listed in the table, so --print_config shows them), bounds, and
relations between knobs. Ranges that a library type already enforces when `build` constructs it
(LossConfig, CorrectionConfig, SamplingConfig, AsyncSchedule, ModelConfig, the task, the mesh
plan, the precision policy) are not written again: the section builds the type and reports its
error under the section's flag. The precision section's knobs are lowrl.precision's
(`precision.KNOBS`, checked by `precision.make_policy`); their values come from a recipe file
(configs/<recipe>.py).
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable

import ml_collections

from lowrl import memory, precision, sharding
from lowrl.rl.advantages import ADVANTAGE_MODES
from lowrl.rl.corrections import CORRECTION_LEVELS, CORRECTION_MODES
from lowrl.rl.kl import KL_ESTIMATORS
from lowrl.rl.losses import AGGREGATIONS, LOSSES
from lowrl.sampling import SamplingConfig
from lowrl.training.loss_scaling import check_loss_scale
from lowrl.training.optimizer import MASTER_DTYPES, MASTER_ROUNDINGS, SCHEDULES
from lowrl.training.rl_update import OLD_LOGP_SOURCES, update_config_from
from lowrl.training.schedule import LAG_DISTRIBUTIONS, AsyncSchedule
from lowrl.training.storage import STORAGES

# ----------------------------------------------------------------------------------------------
# Checks of one knob: (flag, value) -> None, raising ValueError that names --config.<flag>.


@dataclasses.dataclass(frozen=True)
class OneOf:
  """The value is one of `choices`."""

  choices: tuple

  def __call__(self, flag: str, value: Any) -> None:
    if value not in self.choices:
      raise ValueError(f"--config.{flag}={value!r}: use one of "
                       f"{', '.join(map(repr, self.choices))}.")


@dataclasses.dataclass(frozen=True)
class AtLeast:
  """value >= lo (value > lo when `strict`); None passes when `optional`."""

  lo: float
  strict: bool = False
  optional: bool = False
  hint: str = ""  # why, or what the boundary value means, e.g. "0 = never"

  def __call__(self, flag: str, value: Any) -> None:
    if value is None and self.optional:
      return
    if value is None or not (value > self.lo if self.strict else value >= self.lo):
      bound = f"{'>' if self.strict else '>='} {self.lo}" + (" or None" if self.optional else "")
      raise ValueError(f"--config.{flag}={value!r}: must be {bound}"
                       + (f" ({self.hint})" if self.hint else "") + ".")


@dataclasses.dataclass(frozen=True)
class Below:
  """lo <= value < hi."""

  lo: float
  hi: float

  def __call__(self, flag: str, value: Any) -> None:
    if not self.lo <= value < self.hi:
      raise ValueError(f"--config.{flag}={value!r}: must be in [{self.lo}, {self.hi}).")


Check = Callable[[str, Any], None]
# A check of a whole section: (its flag prefix, e.g. "rl", its ConfigDict) -> None.
SectionCheck = Callable[[str, ml_collections.ConfigDict], None]


@dataclasses.dataclass(frozen=True)
class Knob:
  """One `--config.*` knob.

  Attributes:
    name: key within its section.
    default: value of a new config (ignored when `factory` is given).
    doc: one-line meaning (choices are appended from a OneOf check).
    check: per-value check, None when the section's checks (or a type it builds) cover it.
    factory: builds a fresh default (mutable values, typed placeholders).
  """

  name: str
  default: Any
  doc: str
  check: Check | None = None
  factory: Callable[[], Any] | None = None

  @property
  def meaning(self) -> str:
    if isinstance(self.check, OneOf):
      return f"{self.doc}: {' | '.join(map(str, self.check.choices))}"
    return self.doc

  def new_default(self) -> Any:
    return self.factory() if self.factory is not None else self.default


@dataclasses.dataclass(frozen=True)
class Section:
  """A group of knobs under `name` ("" = the config's top level).

  `external`: the values come from elsewhere (the precision recipe), not from `default`s, and are
  checked by their owner; the table only documents them.
  """

  name: str
  knobs: tuple[Knob, ...]
  checks: tuple[SectionCheck, ...] = ()
  external: bool = False

  def flag(self, knob: str) -> str:
    return f"{self.name}.{knob}" if self.name else knob

  def only(self, *names: str) -> Section:
    """This section with only the knobs `names` (in table order): a run kind that lacks the rest."""
    unknown = set(names) - {k.name for k in self.knobs}
    if unknown:
      raise ValueError(f"section {self.name!r} has no knobs {sorted(unknown)}.")
    return dataclasses.replace(self, knobs=tuple(k for k in self.knobs if k.name in names))

  def extended(self, *knobs: Knob, checks: tuple[SectionCheck, ...] = ()) -> Section:
    """This section with more knobs (appended) and checks."""
    return dataclasses.replace(self, knobs=self.knobs + knobs, checks=self.checks + checks)

  def with_defaults(self, **defaults: Any) -> Section:
    """This section with other defaults (another run kind's), e.g. RL.with_defaults(steps=400)."""
    unknown = set(defaults) - {k.name for k in self.knobs}
    if unknown:
      raise ValueError(f"section {self.name!r} has no knobs {sorted(unknown)}.")
    return dataclasses.replace(self, knobs=tuple(
        dataclasses.replace(k, default=defaults[k.name], factory=None) if k.name in defaults
        else k for k in self.knobs))

  def defaults(self) -> ml_collections.ConfigDict:
    """The section's knobs with fresh defaults."""
    return ml_collections.ConfigDict({k.name: k.new_default() for k in self.knobs})

  def validate(self, node: ml_collections.ConfigDict) -> None:
    """Runs the knob checks, then the section checks, on the section's ConfigDict `node`."""
    for k in self.knobs:
      if k.check is not None:
        k.check(self.flag(k.name), node[k.name])
    for check in self.checks:
      check(self.name, node)


@dataclasses.dataclass(frozen=True)
class Schema:
  """The ordered sections of one run kind."""

  sections: tuple[Section, ...]

  def section(self, name: str) -> Section:
    return next(s for s in self.sections if s.name == name)

  def defaults(self, **external: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
    """A new config of every section's defaults; the external sections are given by name
    (e.g. precision=lowrl.precision.recipe("bf16"))."""
    c = ml_collections.ConfigDict()
    for s in self.sections:
      if s.external:
        if s.name not in external:
          raise ValueError(f"the {s.name} section comes from outside the schema; pass "
                           f"{s.name}=... to defaults().")
        c[s.name] = external.pop(s.name)
      elif s.name:
        c[s.name] = s.defaults()
      else:
        for k, v in s.defaults().items():
          c[k] = v
    if external:
      raise ValueError(f"no external sections {sorted(external)} in the schema.")
    return c

  def validate(self, cfg: ml_collections.ConfigDict) -> None:
    """Raises a one-line ValueError naming the flag and the fix for the first bad value."""
    for name, value in flatten(cfg).items():
      if isinstance(value, float) and not math.isfinite(value):
        raise ValueError(f"--config.{name}={value}: must be a finite number.")
    for s in self.sections:
      if not s.external:
        s.validate(cfg[s.name] if s.name else cfg)

  def docs(self, prefix: str = "") -> dict[str, str]:
    """{flag: meaning} of every knob (flags prefixed by `prefix`, e.g. "sim.")."""
    return {prefix + s.flag(k.name): k.meaning for s in self.sections for k in s.knobs}


def flatten(cfg: ml_collections.ConfigDict | dict, prefix: str = "") -> dict[str, Any]:
  """{"rl.loss": "grpo", ...}: every leaf of the config by its dotted flag name."""
  out = {}
  for k, v in (cfg.items() if hasattr(cfg, "items") else []):
    name = f"{prefix}{k}"
    if isinstance(v, (ml_collections.ConfigDict, dict)) and len(v):
      out.update(flatten(v, name + "."))
    else:
      out[name] = v.to_dict() if isinstance(v, ml_collections.ConfigDict) else v
  return out


# ----------------------------------------------------------------------------------------------
# Section checks that build a library type and report its error under the section's flags.


def _rl_update_check(prefix: str, rl: ml_collections.ConfigDict) -> None:
  """Batch divisibility, then the loss / correction / update types' own checks."""
  rows = rl.num_prompts * rl.group_size
  if rows % rl.num_minibatches:
    raise ValueError(f"--config.{prefix}.num_minibatches={rl.num_minibatches}: "
                     f"{prefix}.num_prompts * {prefix}.group_size = {rows} is not divisible by it.")
  mb = rows // rl.num_minibatches
  if rl.micro_batches < 1 or mb % rl.micro_batches:
    raise ValueError(f"--config.{prefix}.micro_batches={rl.micro_batches}: must be >= 1 and "
                     f"divide the minibatch of {mb} sequences ({prefix}.num_prompts * "
                     f"{prefix}.group_size / {prefix}.num_minibatches).")
  try:  # max_len (the Dr.GRPO horizon) depends on the task: build() passes the real one
    update_config_from(rl, master_rounding="nearest", max_len=None)
  except ValueError as e:
    raise ValueError(_under(prefix, e)) from None


def _under(prefix: str, e: ValueError) -> str:
  """A type's error message under the section flag (types name their fields, not the flags)."""
  text = str(e)
  return text if text.startswith((f"{prefix}.", "--config.")) else f"--config.{prefix}: {text}"


def _sampling_check(prefix: str, rl: ml_collections.ConfigDict) -> None:
  """The sampler's own checks (messages start with the field name)."""
  try:
    SamplingConfig(max_new_tokens=rl.max_new_tokens, temperature=rl.temperature, top_k=rl.top_k,
                   top_p=rl.top_p)
  except ValueError as e:
    raise ValueError(f"--config.{prefix}.{e}") from None
  if not 0 <= rl.overlong_buffer <= rl.max_new_tokens:
    raise ValueError(f"--config.{prefix}.overlong_buffer={rl.overlong_buffer}: must be in "
                     f"[0, {prefix}.max_new_tokens={rl.max_new_tokens}] (0 = off).")


def _schedule_check(prefix: str, a: ml_collections.ConfigDict) -> None:
  """The schedule's own checks (messages start with the field name)."""
  try:
    AsyncSchedule(lag=a.lag, sync_every=a.sync_every, lag_distribution=a.lag_distribution)
  except ValueError as e:
    raise ValueError(f"--config.{prefix}.{e}") from None


def _master_check(prefix: str, o: ml_collections.ConfigDict) -> None:
  if o.master_rounding == "stochastic" and o.master_dtype != "bfloat16":
    raise ValueError(f"--config.{prefix}.master_rounding=stochastic rounds BF16 master weights; "
                     f"set --config.{prefix}.master_dtype=bfloat16 too.")


def _task_check(prefix: str, t: ml_collections.ConfigDict) -> None:
  """path/verifier/chat_template belong to the jsonl task (the task checks name and kwargs)."""
  if t.name == "jsonl":
    if not t.path and "path" not in t.kwargs:
      raise ValueError(f"--config.{prefix}.name=jsonl needs --config.{prefix}.path=FILE (one "
                       '{"prompt": ..., "answer": ...} object per line).')
    return
  for knob in ("path", "verifier", "chat_template"):
    if t[knob]:
      raise ValueError(f"--config.{prefix}.{knob} only applies to --config.{prefix}.name=jsonl "
                       f"(task is {t.name!r}); drop it.")


# ----------------------------------------------------------------------------------------------
# The sections.

POSITIVE = AtLeast(1)
NON_NEGATIVE = AtLeast(0)

# The RL knobs of both run kinds (losses, advantages, corrections, batch shape).
RL = Section("rl", (
    Knob("steps", 40, "RL steps (one sampled batch and its update each)", POSITIVE),
    Knob("num_prompts", 32, "prompts per step", POSITIVE),
    Knob("group_size", 8, "completions per prompt (the advantage group)",
         AtLeast(2, hint="group-relative advantages need >= 2 samples per prompt")),
    Knob("advantage", "grpo", "group-relative advantage", OneOf(ADVANTAGE_MODES)),
    Knob("std_ddof", 0, "GRPO group std: 0 population (GRPO paper), 1 sample (TRL, verl, tunix)",
         OneOf((0, 1))),
    Knob("loss", "grpo", "policy loss", OneOf(LOSSES)),
    Knob("aggregation", "", "token aggregation; '' = the loss's paper default (token_mean for "
         "dapo/cispo, seq_mean_token_mean for grpo/gspo)", OneOf(("",) + AGGREGATIONS)),
    Knob("clip_eps_low", 0.2, "PPO clip: ratio >= 1 - clip_eps_low, in [0, 1)"),
    Knob("clip_eps_high", None, "PPO clip: ratio <= 1 + clip_eps_high; None = 0.28 for dapo, "
         "else 0.2", factory=lambda: ml_collections.config_dict.placeholder(float)),
    Knob("cispo_eps_max", 4.0, "CISPO: the detached weight is min(ratio, cispo_eps_max)"),
    Knob("mu", 1, "inner updates per batch against pi_old"),
    Knob("num_minibatches", 1, "PPO minibatches per pass over the batch (minibatch i = rows i, "
         "i + n, ...: strided, so each draws evenly from every data shard)"),
    Knob("micro_batches", 1, "gradient accumulation: each minibatch's gradient summed over this "
         "many micro-batches (strided like minibatches; must divide the minibatch), so only one "
         "micro-batch's activations are live; equal to the whole minibatch's up to FP32 "
         "summation order (1 = off, the plain step)"),
    Knob("old_logp_source", "trainer", "pi_old of the PPO ratio: trainer (recompute; decoupled "
         "PPO, the sampler corrected by rl.correction) or sampler (recorded; rl.correction must "
         "be none)", OneOf(OLD_LOGP_SOURCES)),
    Knob("kl_coef", 0.0, "beta of the KL-to-reference penalty (0 = no penalty)"),
    Knob("kl_estimator", "k3", "KL estimator (docs/reference.md section 3)", OneOf(KL_ESTIMATORS)),
    Knob("correction", "none", "sampler/trainer mismatch correction", OneOf(CORRECTION_MODES)),
    Knob("correction_level", "token", "correction weight per", OneOf(CORRECTION_LEVELS)),
    Knob("tis_cap", 2.0, "TIS: weight truncated at this cap (> 0)"),
    Knob("mis_low", 0.5, "MIS: tokens/sequences with weight below this are masked"),
    Knob("mis_high", 5.0, "MIS: tokens/sequences with weight above this are masked"),
), checks=(_rl_update_check,))

# How rollouts are sampled and filtered: both run kinds.
_SAMPLING_KNOBS = (
    Knob("temperature", 1.0, "rollout temperature",
         AtLeast(0, strict=True, hint="RL rollouts: the importance ratios need a stochastic "
                 "sampler")),
    Knob("top_k", 0, "top-k sampling; 0 = off"),
    Knob("top_p", 1.0, "nucleus sampling in (0, 1]; 1 = off"),
)
_DAPO_KNOBS = (
    Knob("dynamic_sampling", False, "DAPO: drop groups with identical rewards"),
    Knob("overlong_buffer", 0, "DAPO overlong penalty ramp length in tokens (0 = off)"),
)

# The loop's rl section.
TRAIN_RL = RL.extended(
    Knob("max_new_tokens", 8, "completion budget in tokens"),
    *_SAMPLING_KNOBS,
    Knob("ref_reset_every", 0, "steps between resets of pi_ref to the current policy",
         AtLeast(0, hint="0 = never")),
    Knob("log_kl_ref", True, "keep pi_ref (the base) to log KL(pi || pi_ref) even when "
         "kl_coef = 0"),
    Knob("ref_storage", "param", "where pi_ref's params live: param (param dtype on the devices) "
         "| bfloat16 (a BF16 copy: half the memory, the rounded weights' KL) | host (param dtype "
         "in host memory, on the devices only during the step; same numbers as param)",
         OneOf(STORAGES)),
    *_DAPO_KNOBS,
    checks=(_sampling_check,))

# The simulator's rl section: its horizon is the task's length (no max_new_tokens), its
# reference is the run's starting policy (never reset); the sampling checks run in its build.
SIM_RL = RL.extended(*_SAMPLING_KNOBS, *_DAPO_KNOBS)

OPTIMIZER = Section("optimizer", (
    Knob("lr", 2e-4, "AdamW peak learning rate", AtLeast(0, strict=True)),
    Knob("schedule", "constant", "learning-rate schedule after warmup", OneOf(SCHEDULES)),
    Knob("warmup_steps", 0, "linear warmup from 0, in optimizer steps", NON_NEGATIVE),
    Knob("final_lr_fraction", 0.0, "cosine/linear: the final lr as a fraction of lr"),
    Knob("b1", 0.9, "Adam first-moment decay", Below(0, 1)),
    Knob("b2", 0.99, "Adam second-moment decay", Below(0, 1)),
    Knob("eps", 1e-8, "Adam denominator epsilon"),
    Knob("weight_decay", 0.0, "decoupled (AdamW) weight decay"),
    Knob("grad_clip", 1.0, "global gradient-norm clip (None = off)",
         AtLeast(0, strict=True, optional=True)),
    Knob("master_dtype", "float32", "master-weight dtype", OneOf(MASTER_DTYPES)),
    Knob("master_rounding", "nearest", "rounding of BF16 master weights after an update",
         OneOf(MASTER_ROUNDINGS)),
), checks=(_master_check,))


def _loss_scale_check(prefix: str, o: ml_collections.ConfigDict) -> None:
  try:
    check_loss_scale(o.loss_scale)
  except ValueError as e:
    raise ValueError(str(e).replace("--config.optimizer.", f"--config.{prefix}.")) from None


# The loop's optimizer section: + static loss scaling (FP16 compute needs it).
TRAIN_OPTIMIZER = OPTIMIZER.extended(
    Knob("loss_scale", 1.0, "static loss scale, a power of two: the backward runs on gradients "
         "x loss_scale, unscaled before the optimizer (FP16 compute: e.g. 1024; 1 = off)"),
    checks=(_loss_scale_check,))

# Probes of the step logged by the loop (lowrl.training.probes); off by default.
DIAGNOSTICS = Section("diagnostics", (
    Knob("every", 0, "steps between the gradient-bias (recipe vs FP32 gradient: grad_bias/*) and "
         "update-erasure (update_erasure) probes; 0 = off; a probe step that is not a logged "
         "step (log_every) is not logged", NON_NEGATIVE),
))

SFT = Section("sft", (
    Knob("steps", 50, "supervised mid-training steps of the base (0 = RL from the random/loaded "
         "init); the default leaves RL room: held-out pass@1 0.48, greedy 0.70", NON_NEGATIVE),
    Knob("batch_size", 128, "SFT sequences per step", POSITIVE),
    Knob("lr", 3e-3, "SFT Adam learning rate", AtLeast(0, strict=True)),
    Knob("warmup_steps", 20, "SFT linear warmup steps", NON_NEGATIVE),
    Knob("base_dir", "", "store of mid-trained bases, keyed by fingerprint: '' = the shared "
         "<user cache>/bases (~/.cache/lowrl/bases; $LOWRL_CACHE_DIR, $XDG_CACHE_HOME), "
         "'none' = <workdir>/base (not shared), or a directory"),
))
# The loop's sft section: one base can serve runs of several seeds.
TRAIN_SFT = SFT.extended(
    Knob("seed", -1, "seed of the base (init and SFT data); -1 = the run's seed (set it to share "
         "one base between runs of different seeds)", AtLeast(-1)))

ASYNC_RL = Section("async_rl", (
    Knob("lag", 0, "sampler version = trainer version - lag (>= 0; 0 = synchronous)"),
    Knob("sync_every", 1, "steps between weight syncs to the sampler (>= 1)"),
    Knob("lag_distribution", "fixed", "lag draws: " + " | ".join(LAG_DISTRIBUTIONS)),
), checks=(_schedule_check,))

# The loop's async section: the simulator keeps no parameter versions.
TRAIN_ASYNC_RL = ASYNC_RL.extended(
    Knob("version_storage", "param", "where the parameter versions kept for a stale sampler "
         "live: param | bfloat16 (the sampler then samples the BF16-rounded version) | host (as "
         "rl.ref_storage)", OneOf(STORAGES)),
)

# The decoder (ModelConfig checks the values when build() constructs it). The defaults are the
# loop's ~0.8M-parameter base: a forward+backward on 512x48 tokens is ~2 s on 2 CPU cores.
MODEL = Section("model", (
    Knob("d_model", 128, "model width"),
    Knob("n_layers", 4, "decoder layers"),
    Knob("n_heads", 4, "attention (query) heads"),
    Knob("n_kv_heads", 2, "key/value heads (GQA; divides n_heads)"),
    Knob("head_dim", 32, "per-head width"),
    Knob("d_ff", 384, "SwiGLU hidden width"),
    Knob("rope_theta", 10000.0, "rotary embedding base"),
    Knob("qk_norm", False, "RMSNorm on q and k per head (Qwen3)"),
    Knob("tie_embeddings", True, "LM head = embedding transpose"),
    Knob("n_experts", 0, "mixture-of-experts MLP: routed experts per block (0 = the dense "
         "SwiGLU of width d_ff; lowrl/models/moe.py)"),
    Knob("n_experts_per_tok", 0, "experts each token is routed to (top-k), with n_experts"),
    Knob("moe_d_ff", 0, "hidden width of each routed expert, with n_experts"),
    Knob("norm_topk_prob", False, "renormalise the k selected router probabilities (Qwen3-MoE)"),
    Knob("shared_expert_d_ff", 0, "Qwen2-MoE shared expert width (0 = none), with n_experts"),
    # Memory/compile knobs at real sizes (lowrl.models.config.ModelConfig); none changes a bit.
    Knob("scan_layers", False, "layers as lax.scans (compile size independent of depth)"),
    Knob("remat", "none", "per-layer rematerialisation: none | full | dots"),
    Knob("attention", "materialized", "materialized | chunked (attention_chunk query rows at a "
         "time; equal up to FP32 reassociation)"),
    Knob("attention_chunk", 512, "query rows per chunk of attention=chunked"),
    Knob("logprob_chunk", 0, "vocabulary chunk of the LM head + log-softmax (0 = the full "
         "[B, T, V]; equal up to FP32 reassociation)"),
))

# The architecture knobs of MODEL: a checkpoint's config.json sets them instead.
_ARCHITECTURE = ("d_model", "n_layers", "n_heads", "n_kv_heads", "head_dim", "d_ff", "rope_theta",
                 "qk_norm", "tie_embeddings", "n_experts", "n_experts_per_tok", "moe_d_ff",
                 "norm_topk_prob", "shared_expert_d_ff")
PARAM_DTYPES = ("float32", "bfloat16")


def _checkpoint_check(prefix: str, m: ml_collections.ConfigDict) -> None:
  """With hf_checkpoint, the architecture comes from its config.json: a changed architecture
  knob would be silently ignored, so it is an error (as param_dtype without a checkpoint)."""
  if not m.hf_checkpoint:
    if m.param_dtype != "float32":
      raise ValueError(f"--config.{prefix}.param_dtype={m.param_dtype!r} applies to "
                       f"--config.{prefix}.hf_checkpoint only (the tiny model starts in FP32; "
                       "--config.optimizer.master_dtype sets the trained dtype); drop it.")
    return
  defaults = {k.name: k.default for k in MODEL.knobs}
  changed = [k for k in _ARCHITECTURE if m[k] != defaults[k]]
  if changed:
    raise ValueError(f"--config.{prefix}.{changed[0]}={m[changed[0]]!r} does not apply with "
                     f"--config.{prefix}.hf_checkpoint (the checkpoint's config.json sets the "
                     "architecture); drop it.")


# The loop's model section: MODEL, a real checkpoint instead of the tiny architecture, and
# scan_layers defaulting on for a checkpoint (None = on with hf_checkpoint, off without, so the
# tiny path's program is unchanged).
TRAIN_MODEL = Section("model", (
    Knob("hf_checkpoint", "", "'' = the tiny model (architecture knobs above, SFT from scratch); "
         "a Hugging Face Llama/Qwen2/Qwen3 directory (config.json, *.safetensors, tokenizer.json): "
         "architecture, params and tokenizer from it (needs task.name=jsonl, sft.steps=0)"),
    Knob("param_dtype", "float32", "dtype the hf_checkpoint params are loaded in (then held in "
         "optimizer.master_dtype)", OneOf(PARAM_DTYPES)),
) + tuple(
    dataclasses.replace(k, default=None, doc=k.doc + "; None = on with hf_checkpoint, else off",
                        factory=lambda: ml_collections.config_dict.placeholder(bool))
    if k.name == "scan_layers" else k for k in MODEL.knobs), checks=(_checkpoint_check,))

PRECISION = Section("precision", tuple(Knob(k, None, doc) for k, doc in precision.KNOBS.items()),
                    external=True)

# The per-device memory budget build() checks the estimate against (lowrl.memory), before any
# compile.
HARDWARE = Knob("hardware", memory.AUTO, "device memory the per-device estimate must fit in: "
                "auto (the backend's memory_stats; no limit on CPU), none (no check) or a "
                "lowrl.hardware preset", OneOf(memory.HARDWARE_CHOICES))

EVAL_NUM_PROMPTS = Knob("eval_num_prompts", 256, "held-out eval-split prompts", POSITIVE)

# The training loop (configs/base.py). Sections in the order --print_config lists them.
TRAIN = Schema((
    Section("", (Knob("seed", 0, "seeds init, data order, sampling and the held-out eval set"),)),
    # Sorting 3-6 letters (configs/base.py says why).
    Section("task", (
        Knob("name", "sorting", "task (lowrl.tasks.registry; jsonl = a file)"),
        Knob("path", "", "task.name=jsonl only: the JSONL file"),
        Knob("verifier", "", "task.name=jsonl only: '' = exact; numeric, boxed, ... "
             "(lowrl.tasks.verifiers)"),
        Knob("chat_template", False, "task.name=jsonl with model.hf_checkpoint only: each prompt "
             "as one user message in the checkpoint's chat template (+ assistant header)"),
        Knob("kwargs", None, "other constructor arguments of the task (e.g. {'num_digits': 1} for "
             "addition), set in a config file", factory=lambda: ml_collections.ConfigDict({})),
    ), checks=(_task_check,)),
    TRAIN_MODEL,
    PRECISION,
    Section("sampler_precision", (
        Knob("recipe", "", "sampler precision recipe; '' = the trainer's",
             OneOf(("",) + precision.RECIPES)),
        Knob("kv_cache", "none", "the sampler's KV cache: none (compute_dtype) | FP8 E4M3 with "
             "static per-tensor / per-head scales | NVFP4 (head_dim % 16 == 0); scales "
             "calibrated at every weight sync, the trainer scores with unquantized K/V "
             "(docs/sampling.md)", OneOf(precision.KV_CACHE_MODES)),)),
    Section("", (Knob("sampler_exact", True, "sampler logprobs from the trainer's forward "
                      "(bit-identical when same recipe)"),
                 Knob("refit_check_every", 1, "weight syncs between refit checks (the sampler's "
                      "quantized weights and scales vs a fresh quantization of the trainer's, "
                      "bit for bit; metric refit/mismatched_tensors); 0 = off", NON_NEGATIVE))),
    TRAIN_SFT,
    TRAIN_RL,
    TRAIN_OPTIMIZER,
    Section("", (
        EVAL_NUM_PROMPTS,
        Knob("eval_samples", 4, "samples per eval prompt for pass@1 at the rollout temperature",
             POSITIVE),
        Knob("eval_every", 10, "steps between held-out evaluations besides the start and the end "
             "(0 = only there); each costs ~5 rollouts of sampling", NON_NEGATIVE),
        Knob("log_every", 1, "steps between TensorBoard / metrics.jsonl points", POSITIVE),
        Knob("checkpoint_every", 10, "steps between checkpoints (the newest 2 intact ones are "
             "kept)", POSITIVE),
        Knob("num_text_samples", 4, "sample completions shown in TensorBoard per logged step",
             NON_NEGATIVE),
        Knob("max_skipped_steps", 3, "stop (naming the last good checkpoint) after this many "
             "consecutive RL steps with a skipped optimizer update (non-finite loss, gradient or "
             "new parameters)", POSITIVE),
    )),
    DIAGNOSTICS,
    TRAIN_ASYNC_RL,
    # The mesh spans every process's devices (sharding.plan_from_config checks it).
    Section("mesh", (
        Knob("shape", (-1, 1), "devices per mesh axis; -1 = the remaining devices"),
        Knob("axes", ("data", "model"), "mesh axis names (data: batch + FSDP, model: tensor "
             "parallel)"),
        Knob("batch_axes", ("data",), "mesh axes the batch (rollouts, KV cache) is split over"),
        Knob("rules", sharding.DEFAULT_RULES, "(regex over parameter paths, partition spec); "
             "first fullmatch wins, unmatched = replicated"),
        Knob("strict", False, "True: a rule axis not dividing its dim is an error (else: "
             "replicated)"),
    )),
    Section("", (HARDWARE,)),
))
