"""The config schema: every knob of a run once, with its check and its meaning; not its value.

The sections of the training loop (`TRAIN`; its values are the data of configs/base.py;
`setup.build` validates it) and the ones the simulator shares (`lowrl.asyncrl.simulator.SCHEMA`,
these plus its own, with its values still in its table: `Knob.default`; `simulator.build`
validates it), built with lowrl.training.knobs (`knob(name, meaning, check)`, `Section`, `Schema`:
`validate` raises a one-line ValueError naming the `--config.*` flag and the fix, a knob missing
from the config or not in the schema included; `docs()` gives the meanings `--print_config`
shows). Adding a knob to the loop: one line in configs/base.py, its `knob(...)` line here.

What the schema checks: the knobs present (types: ml_collections keeps each value's type from the
config file), choices (listed in the table, so --print_config shows them), bounds, and relations
between knobs. Ranges that a library type already enforces when `build` constructs it
(LossConfig, CorrectionConfig, SamplingConfig, AsyncSchedule, ModelConfig, the task, the mesh
plan, the precision policy) are not written again: the section builds the type and reports its
error under the section's flag. The precision section's knobs are lowrl.precision's
(`precision.KNOBS`, checked by `precision.make_policy`); their values come from a named recipe
(lowrl/recipes.py).
"""
from __future__ import annotations

import dataclasses

import ml_collections

from lowrl import memory, precision, sharding
from lowrl.models.lora import ADAPTER_DTYPES
from lowrl.rl.advantages import ADVANTAGE_MODES
from lowrl.rl.corrections import CORRECTION_LEVELS, CORRECTION_MODES
from lowrl.rl.kl import KL_ESTIMATORS
from lowrl.rl.losses import AGGREGATIONS, LOSSES
from lowrl.sampling import SamplingConfig
from lowrl.training.knobs import (UNSET, AtLeast, Below, Check, Knob, OneOf, Schema,  # noqa: F401
                                  Section, SectionCheck, as_flags, flatten, knob, NON_NEGATIVE,
                                  POSITIVE)
from lowrl.training.compute_cast import ROUNDINGS as COMPUTE_CAST_ROUNDINGS
from lowrl.training.loss_scaling import check_loss_scale
from lowrl.training.optimizer import MASTER_DTYPES, MASTER_ROUNDINGS, SCHEDULES
from lowrl.training.rl_update import OLD_LOGP_SOURCES, update_config_from
from lowrl.training.schedule import LAG_DISTRIBUTIONS, AsyncSchedule
from lowrl.training.storage import STORAGES

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
    raise ValueError(_under(prefix, rl, e)) from None


def _under(prefix: str, node: ml_collections.ConfigDict, e: ValueError) -> str:
  """A type's error message under the section's flags (types name their fields, not the flags)."""
  text = as_flags(str(e), prefix, node.keys())
  return text if text.startswith("--config.") else f"--config.{prefix}: {text}"


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

# The RL knobs of both run kinds (losses, advantages, corrections, batch shape).
RL = Section("rl", (
    knob("steps", "RL steps (one sampled batch and its update each)", POSITIVE),
    knob("num_prompts", "prompts per step", POSITIVE),
    knob("group_size", "completions per prompt (the advantage group)",
         AtLeast(2, hint="group-relative advantages need >= 2 samples per prompt")),
    knob("advantage", "group-relative advantage", OneOf(ADVANTAGE_MODES)),
    knob("std_ddof", "GRPO group std: 0 population (GRPO paper), 1 sample (TRL, verl, tunix)",
         OneOf((0, 1))),
    knob("loss", "policy loss", OneOf(LOSSES)),
    knob("aggregation", "token aggregation; '' = the loss's paper default (token_mean for "
         "dapo/cispo, seq_mean_token_mean for grpo/gspo)", OneOf(("",) + AGGREGATIONS)),
    knob("clip_eps_low", "PPO clip: ratio >= 1 - clip_eps_low, in [0, 1)"),
    knob("clip_eps_high", "PPO clip: ratio <= 1 + clip_eps_high; None = 0.28 for dapo, "
         "else 0.2"),
    knob("cispo_eps_max", "CISPO: the detached weight is min(ratio, cispo_eps_max)"),
    knob("mu", "inner updates per batch against pi_old"),
    knob("num_minibatches", "PPO minibatches per pass over the batch (minibatch i = rows i, "
         "i + n, ...: strided, so each draws evenly from every data shard)"),
    knob("micro_batches", "gradient accumulation: each minibatch's gradient summed over this "
         "many micro-batches (strided like minibatches; must divide the minibatch), so only one "
         "micro-batch's activations are live; equal to the whole minibatch's up to FP32 "
         "summation order (1 = off, the plain step)"),
    knob("old_logp_source", "pi_old of the PPO ratio: trainer (recompute; decoupled "
         "PPO, the sampler corrected by rl.correction) or sampler (recorded; rl.correction must "
         "be none)", OneOf(OLD_LOGP_SOURCES)),
    knob("kl_coef", "beta of the KL-to-reference penalty (0 = no penalty)"),
    knob("kl_estimator", "KL estimator (docs/reference.md section 3)", OneOf(KL_ESTIMATORS)),
    knob("correction", "sampler/trainer mismatch correction (icepop: token mask to "
         "[mis_low, mis_high]; vcpo: TIS weights + step scaled by sqrt(ESS/N); lowrl.rl."
         "corrections)", OneOf(CORRECTION_MODES)),
    knob("correction_level", "correction weight per", OneOf(CORRECTION_LEVELS)),
    knob("tis_cap", "TIS, VCPO: weight truncated at this cap (> 0)"),
    knob("mis_low", "MIS, IcePop (alpha): tokens/sequences with weight below this are masked"),
    knob("mis_high", "MIS, IcePop (beta): tokens/sequences with weight above this are masked"),
), checks=(_rl_update_check,))

# How rollouts are sampled and filtered: both run kinds.
_SAMPLING_KNOBS = (
    knob("temperature", "rollout temperature",
         AtLeast(0, strict=True, hint="RL rollouts: the importance ratios need a stochastic "
                 "sampler")),
    knob("top_k", "top-k sampling; 0 = off"),
    knob("top_p", "nucleus sampling in (0, 1]; 1 = off"),
)
_DAPO_KNOBS = (
    knob("dynamic_sampling", "DAPO: drop groups with identical rewards"),
    knob("overlong_buffer", "DAPO overlong penalty ramp length in tokens (0 = off)"),
)

# The loop's rl section.
TRAIN_RL = RL.extended(
    knob("max_new_tokens", "completion budget in tokens"),
    *_SAMPLING_KNOBS,
    knob("pack_tokens", "packed update and scoring: sequences (no padding) packed into rows "
         "of this many tokens (>= prompt width + max_new_tokens), attention and positions per "
         "sequence (lowrl/models/packing.py), each PPO minibatch packed on its own; needs "
         "micro_batches = 1 (packing makes its own micro-batches); "
         "0 = padded rows", NON_NEGATIVE),
    knob("pack_rows", "packed rows per data shard in one micro-batch (its token budget: "
         "pack_rows * pack_tokens); the update accumulates gradients over the micro-batches "
         "in use", POSITIVE),
    knob("routing_replay", "MoE routing replay (R3): the trainer's forwards (pi_old and "
         "the update) send each token to the experts the sampler chose, combine weights from "
         "the trainer's own router (lowrl/models/routing.py)"),
    knob("ref_reset_every", "steps between resets of pi_ref to the current policy",
         AtLeast(0, hint="0 = never")),
    knob("log_kl_ref", "keep pi_ref (the base) to log KL(pi || pi_ref) even when "
         "kl_coef = 0"),
    knob("ref_storage", "where pi_ref's params live: param (param dtype on the devices) "
         "| bfloat16 (a BF16 copy: half the memory, the rounded weights' KL) | host (param dtype "
         "in host memory, on the devices only during the step; same numbers as param)",
         OneOf(STORAGES)),
    *_DAPO_KNOBS,
    checks=(_sampling_check,))

# The simulator's rl section: its horizon is the task's length (no max_new_tokens), its
# reference is the run's starting policy (never reset); the sampling checks run in its build.
_SIM_RL = RL.extended(*_SAMPLING_KNOBS, *_DAPO_KNOBS)

_OPTIMIZER = Section("optimizer", (
    knob("lr", "AdamW peak learning rate", AtLeast(0, strict=True)),
    knob("schedule", "learning-rate schedule after warmup", OneOf(SCHEDULES)),
    knob("warmup_steps", "linear warmup from 0, in optimizer steps", NON_NEGATIVE),
    knob("final_lr_fraction", "cosine/linear: the final lr as a fraction of lr"),
    knob("b1", "Adam first-moment decay", Below(0, 1)),
    knob("b2", "Adam second-moment decay", Below(0, 1)),
    knob("eps", "Adam denominator epsilon"),
    knob("weight_decay", "decoupled (AdamW) weight decay"),
    knob("grad_clip", "global gradient-norm clip (None = off)",
         AtLeast(0, strict=True, optional=True)),
    knob("master_dtype", "master-weight dtype", OneOf(MASTER_DTYPES)),
    knob("master_rounding", "rounding of BF16 master weights after an update",
         OneOf(MASTER_ROUNDINGS)),
), checks=(_master_check,))


def _loss_scale_check(prefix: str, o: ml_collections.ConfigDict) -> None:
  try:
    check_loss_scale(o.loss_scale)
  except ValueError as e:
    raise ValueError(str(e).replace("--config.optimizer.", f"--config.{prefix}.")) from None


# The loop's optimizer section: + static loss scaling (FP16 compute needs it).
TRAIN_OPTIMIZER = _OPTIMIZER.extended(
    knob("loss_scale", "static loss scale, a power of two: the backward runs on gradients "
         "x loss_scale, unscaled before the optimizer (FP16 compute: e.g. 1024; 1 = off)"),
    knob("compute_cast_rounding", "rounding of the trainer's FP32 -> BF16 cast of the BF16 "
         "GEMMs' weights for each update: nearest | stochastic (unbiased, a fresh key per "
         "update; needs FP32 master weights, precision.compute_dtype=bfloat16, format=none; "
         "sampler, eval and reference stay nearest: lowrl/training/compute_cast.py)",
         OneOf(COMPUTE_CAST_ROUNDINGS)),
    checks=(_loss_scale_check,))

# Probes of the step logged by the loop (lowrl.training.probes); off by default.
DIAGNOSTICS = Section("diagnostics", (
    knob("every", "steps between the gradient-bias (recipe vs FP32 gradient: grad_bias/*) and "
         "update-erasure (update_erasure) probes; 0 = off; a probe step that is not a logged "
         "step (log_every) is not logged", NON_NEGATIVE),
    knob("code_churn", "log per RL step the fraction of the sampler policy's quantized weight "
         "codes, dequantized values and block scales the step's update changes "
         "(code_churn/*: lowrl/training/code_churn.py); other metrics unchanged"),
))

_SFT = Section("sft", (
    knob("steps", "supervised mid-training steps of the base (0 = RL from the random/loaded "
         "init); the default leaves RL room: held-out pass@1 0.48, greedy 0.70", NON_NEGATIVE),
    knob("batch_size", "SFT sequences per step", POSITIVE),
    knob("lr", "SFT Adam learning rate", AtLeast(0, strict=True)),
    knob("warmup_steps", "SFT linear warmup steps", NON_NEGATIVE),
    knob("base_dir", "store of mid-trained bases, keyed by fingerprint: '' = the shared "
         "<user cache>/bases (~/.cache/lowrl/bases; $LOWRL_CACHE_DIR, $XDG_CACHE_HOME), "
         "'none' = <workdir>/base (not shared), or a directory"),
))
# The loop's sft section: one base can serve runs of several seeds.
TRAIN_SFT = _SFT.extended(
    knob("seed", "seed of the base (init and SFT data); -1 = the run's seed (set it to share "
         "one base between runs of different seeds)", AtLeast(-1)),
    knob("outlier_channels", "outlier channels planted in the base once loaded (the stored "
         "base is unchanged): n evenly spaced channels whose attn/mlp RMSNorm gains are x "
         "outlier_gain and whose q/k/v, gate/up kernel rows are / outlier_gain, the same "
         "function (lowrl/training/outliers.py); 0 = none", NON_NEGATIVE),
    knob("outlier_gain", "gain of the planted outlier channels (sft.outlier_channels)",
         AtLeast(1)))

ASYNC_RL = Section("async_rl", (
    knob("lag", "sampler version = trainer version - lag (>= 0; 0 = synchronous)"),
    knob("sync_every", "steps between weight syncs to the sampler (>= 1)"),
    knob("lag_distribution", "lag draws: " + " | ".join(LAG_DISTRIBUTIONS)),
), checks=(_schedule_check,))

# The loop's async section: the simulator keeps no parameter versions.
TRAIN_ASYNC_RL = ASYNC_RL.extended(
    knob("version_storage", "where the parameter versions kept for a stale sampler "
         "live: param | bfloat16 (the sampler then samples the BF16-rounded version) | host (as "
         "rl.ref_storage)", OneOf(STORAGES)),
)

# The decoder (ModelConfig checks the values when build() constructs it). The defaults are the
# loop's ~0.8M-parameter base: a forward+backward on 512x48 tokens is ~2 s on 2 CPU cores.
_MODEL = Section("model", (
    knob("d_model", "model width"),
    knob("n_layers", "decoder layers"),
    knob("n_heads", "attention (query) heads"),
    knob("n_kv_heads", "key/value heads (GQA; divides n_heads)"),
    knob("head_dim", "per-head width"),
    knob("d_ff", "SwiGLU hidden width"),
    knob("rope_theta", "rotary embedding base"),
    knob("qk_norm", "RMSNorm on q and k per head (Qwen3)"),
    knob("tie_embeddings", "LM head = embedding transpose"),
    knob("n_experts", "mixture-of-experts MLP: routed experts per block (0 = the dense "
         "SwiGLU of width d_ff; lowrl/models/moe.py)"),
    knob("n_experts_per_tok", "experts each token is routed to (top-k), with n_experts"),
    knob("moe_d_ff", "hidden width of each routed expert, with n_experts"),
    knob("norm_topk_prob", "renormalise the k selected router probabilities (Qwen3-MoE)"),
    knob("shared_expert_d_ff", "Qwen2-MoE shared expert width (0 = none), with n_experts"),
    # Memory/compile knobs at real sizes (lowrl.models.config.ModelConfig); none changes a bit.
    knob("scan_layers", "layers as lax.scans (compile size independent of depth)"),
    knob("remat", "per-layer rematerialisation: none | full | dots"),
    knob("attention", "materialized | chunked (attention_chunk query rows at a "
         "time; equal up to FP32 reassociation)"),
    knob("attention_chunk", "query rows per chunk of attention=chunked"),
    knob("logprob_chunk", "vocabulary chunk of the LM head + log-softmax (0 = the full "
         "[B, T, V]; equal up to FP32 reassociation)"),
))

# The tiny decoder's architecture (configs/base.py's model values, which the check below needs
# to tell a changed knob): with model.hf_checkpoint the checkpoint's config.json sets these, and a
# value changed from the tiny one would be silently ignored. Change both together
# (tests/training/test_schema.py checks they agree).
TINY_ARCHITECTURE = {"d_model": 128, "n_layers": 4, "n_heads": 4, "n_kv_heads": 2, "head_dim": 32,
                     "d_ff": 384, "rope_theta": 10000.0, "qk_norm": False, "tie_embeddings": True,
                     "n_experts": 0, "n_experts_per_tok": 0, "moe_d_ff": 0,
                     "norm_topk_prob": False, "shared_expert_d_ff": 0}
PARAM_DTYPES = ("float32", "bfloat16")


def _checkpoint_check(prefix: str, m: ml_collections.ConfigDict) -> None:
  """With hf_checkpoint, the architecture comes from its config.json: a changed architecture
  knob would be silently ignored, so it is an error (as param_dtype without a checkpoint)."""
  if not m.hf_checkpoint:
    if m.param_dtype != "float32":
      raise ValueError(f"--config.{prefix}.param_dtype={m.param_dtype!r} applies to "
                       f"--config.{prefix}.hf_checkpoint only (the tiny model starts in FP32; "
                       "--config.optimizer.master_dtype sets the trained dtype); drop it.")
    if m.eos_token:
      raise ValueError(f"--config.{prefix}.eos_token={m.eos_token!r} applies to "
                       f"--config.{prefix}.hf_checkpoint only (lowrl's tasks bring their own "
                       "tokenizer); drop it.")
    return
  changed = [k for k, v in TINY_ARCHITECTURE.items() if m[k] != v]
  if changed:
    raise ValueError(f"--config.{prefix}.{changed[0]}={m[changed[0]]!r} does not apply with "
                     f"--config.{prefix}.hf_checkpoint (the checkpoint's config.json sets the "
                     "architecture); drop it.")


# The loop's model section: MODEL, a real checkpoint instead of the tiny architecture, and
# scan_layers defaulting on for a checkpoint (None = on with hf_checkpoint, off without, so the
# tiny path's program is unchanged).
TRAIN_MODEL = Section("model", (
    knob("hf_checkpoint", "'' = the tiny model (architecture knobs above, SFT from scratch); "
         "a Hugging Face Llama/Qwen2/Qwen3 directory (config.json, *.safetensors, tokenizer.json) "
         "or a llama.cpp .gguf file (dequantized to FP32): architecture, params and tokenizer "
         "from it (needs task.name=jsonl, sft.steps=0)"),
    knob("param_dtype", "dtype the hf_checkpoint params are loaded in (then held in "
         "optimizer.master_dtype)", OneOf(PARAM_DTYPES)),
    knob("eos_token", "'' = the hf_checkpoint's eos tokens (tokenizer_config.json, "
         "generation_config.json, config.json); else a token of its tokenizer.json that alone "
         "ends completions (for a checkpoint whose files name none)"),
) + tuple(
    dataclasses.replace(k, doc=k.doc + "; None = on with hf_checkpoint, else off")
    if k.name == "scan_layers" else k for k in _MODEL.knobs), checks=(_checkpoint_check,))

PRECISION = Section("precision", tuple(knob(k, doc) for k, doc in precision.KNOBS.items()),
                    external=True)

# The per-device memory budget build() checks the estimate against (lowrl.memory), before any
# compile.
HARDWARE = knob("hardware", "device memory the per-device estimate must fit in: "
                "auto (the backend's memory_stats; no limit on CPU), none (no check) or a "
                "lowrl.hardware preset", OneOf(memory.HARDWARE_CHOICES))

def _fractions(flag: str, value) -> None:
  """A tuple of fractions in (0, 1]."""
  if not isinstance(value, (tuple, list)) or not all(
      isinstance(f, (int, float)) and 0 < f <= 1 for f in value):
    raise ValueError(f"--config.{flag}={value!r}: a tuple of fractions in (0, 1], e.g. "
                     "'(0.25,0.5)'; () = none.")


LORA = Section("lora", (
    knob("rank", "LoRA adapter rank r (0 = off: every weight trained); the base is then frozen "
         "and only the adapters are trained and synced (docs/lora.md)", NON_NEGATIVE),
    knob("alpha", "the adapters' output scale is alpha / rank (PEFT's lora_alpha)"),
    knob("targets", "regex (fullmatch) over matmul paths (layers_3/attn/q_proj, lm_head) that "
         "get adapters; default: every linear layer of the blocks (PEFT's all-linear)"),
    knob("dtype", "precision of the adapter products' operands (FP32 accumulation): " +
         " | ".join(ADAPTER_DTYPES), OneOf(ADAPTER_DTYPES)),
    knob("packed_base", "the trainer holds the frozen base's quantized kernels packed (4-bit "
         "codes + scales, quantized once at load; no master copy): needs "
         "precision.backward=dequantized (docs/lora.md)"),
    knob("aqn_sigma_start", "QeRL's adaptive quantization noise: N(0, sigma^2) added to the "
         "frozen base's RMSNorm weights, sigma decaying from this (0 = off) to aqn_sigma_end "
         "(lowrl/training/aqn.py)"),
    knob("aqn_sigma_end", "AQN: the noise scale of the last stage (0 < end <= start)"),
    knob("aqn_stages", "AQN: the run's steps cut into this many intervals, the first without "
         "noise (>= 2)"),
))

_EVAL_NUM_PROMPTS = knob("eval_num_prompts", "held-out eval-split prompts", POSITIVE)

# The training loop (configs/base.py). Sections in the order --print_config lists them.
TRAIN = Schema((
    Section("", (knob("seed", "seeds init, data order, sampling and the held-out eval set"),)),
    # Sorting 3-6 letters (configs/base.py says why).
    Section("task", (
        knob("name", "task (lowrl.tasks.registry; jsonl = a file)"),
        knob("path", "task.name=jsonl only: the JSONL file"),
        knob("verifier", "task.name=jsonl only: '' = exact; numeric, boxed, ... "
             "(lowrl.tasks.verifiers)"),
        knob("chat_template", "task.name=jsonl with model.hf_checkpoint only: each prompt "
             "as one user message in the checkpoint's chat template (+ assistant header)"),
        knob("kwargs", "other constructor arguments of the task (e.g. {'num_digits': 1} for "
             "addition), set in a config file"),
    ), checks=(_task_check,)),
    TRAIN_MODEL,
    PRECISION,
    Section("sampler_precision", (
        knob("recipe", "sampler precision recipe; '' = the trainer's",
             OneOf(("",) + precision.RECIPES)),
        knob("kv_cache", "the sampler's KV cache: none (compute_dtype) | FP8 E4M3 with "
             "static per-tensor / per-head scales | NVFP4 (head_dim % 16 == 0); scales "
             "calibrated at every weight sync, the trainer scores with unquantized K/V "
             "(docs/sampling.md)", OneOf(precision.KV_CACHE_MODES)),)),
    Section("", (knob("sampler_exact", "sampler logprobs from the trainer's forward "
                      "(bit-identical when same recipe)"),
                 knob("refit_check_every", "weight syncs between refit checks (the sampler's "
                      "quantized weights and scales vs a fresh quantization of the trainer's, "
                      "bit for bit; metric refit/mismatched_tensors); 0 = off", NON_NEGATIVE),
                 knob("sampler_decode_min_rows", "decode compaction: as rollout rows finish, "
                      "the live ones move into buckets of half the rows, down to this many "
                      "rows per data shard, so finished rows stop costing decode compute (the "
                      "same tokens; docs/sampling.md); 0 = off", NON_NEGATIVE),
                 knob("sampler_decode_buckets_per_halving", "decode compaction: buckets per "
                      "halving of the rows (1 = halving; k: each bucket 2^(-1/k) of the last, "
                      "less compute on finished rows for k times the decode segments to "
                      "compile)", POSITIVE))),
    LORA,
    TRAIN_SFT,
    TRAIN_RL,
    TRAIN_OPTIMIZER,
    Section("", (
        _EVAL_NUM_PROMPTS,
        knob("eval_samples", "samples per eval prompt for pass@1 at the rollout temperature",
             POSITIVE),
        knob("eval_every", "steps between held-out evaluations besides the start and the end "
             "(0 = only there); each costs ~5 rollouts of sampling", NON_NEGATIVE),
        knob("log_every", "steps between TensorBoard / metrics.jsonl points", POSITIVE),
        knob("checkpoint_every", "steps between checkpoints (the newest 2 intact ones are "
             "kept)", POSITIVE),
        knob("checkpoint_keep_fractions", "fractions f in (0, 1] of rl.steps whose checkpoints "
             "(step round(f x rl.steps), half up) are saved too and never rotated away, beside "
             "the newest 2 (experiments/paired.py's distance at several points of a run); () "
             "= none", _fractions),
        knob("num_text_samples", "sample completions shown in TensorBoard per logged step",
             NON_NEGATIVE),
        knob("max_skipped_steps", "stop (naming the last good checkpoint) after this many "
             "consecutive RL steps with a skipped optimizer update (non-finite loss, gradient or "
             "new parameters)", POSITIVE),
        knob("precompile", "compile the first RL step's update and exact re-score on a "
             "background thread while the base trains and the start evaluation runs "
             "(lowrl/training/precompile.py): less waiting where a core is free, none saved "
             "on 2 busy cores (docs/benchmarks.md); the same programs and values either way; "
             "False = each compiled when first called"),
    )),
    DIAGNOSTICS,
    TRAIN_ASYNC_RL,
    # The mesh spans every process's devices (sharding.plan_from_config checks it).
    Section("mesh", (
        knob("shape", "devices per mesh axis; -1 = the remaining devices"),
        knob("axes", "mesh axis names (data: batch + FSDP, model: tensor "
             "parallel)"),
        knob("batch_axes", "mesh axes the batch (rollouts, KV cache) is split over"),
        knob("rules", "(regex over parameter paths, partition spec); "
             "first fullmatch wins, unmatched = replicated"),
        knob("strict", "True: a rule axis not dividing its dim is an error (else: "
             "replicated)"),
    )),
    Section("", (HARDWARE,)),
))


# ----------------------------------------------------------------------------------------------
# The simulator's values of the sections it shares with the loop: its SCHEMA
# (lowrl.asyncrl.simulator) takes MODEL, SIM_RL, OPTIMIZER, SFT and EVAL_NUM_PROMPTS and overrides
# a few with `with_defaults`. The loop's own values are configs/base.py; these stay with the
# simulator's table until its values become data of its own config file.

MODEL = _MODEL.with_defaults(
    rope_theta=10000.0, qk_norm=False, tie_embeddings=True, n_experts=0, n_experts_per_tok=0,
    moe_d_ff=0, norm_topk_prob=False, shared_expert_d_ff=0, scan_layers=False, remat="none",
    attention="materialized", attention_chunk=512, logprob_chunk=0)
SIM_RL = _SIM_RL.with_defaults(
    advantage="grpo", std_ddof=0, loss="grpo", aggregation="", clip_eps_low=0.2,
    clip_eps_high=None, cispo_eps_max=4.0, mu=1,
    num_minibatches=1, micro_batches=1, old_logp_source="trainer", kl_coef=0.0,
    kl_estimator="k3", correction="none", correction_level="token", tis_cap=2.0, mis_low=0.5,
    mis_high=5.0, temperature=1.0, top_k=0, top_p=1.0, dynamic_sampling=False, overlong_buffer=0)
OPTIMIZER = _OPTIMIZER.with_defaults(
    schedule="constant", warmup_steps=0, final_lr_fraction=0.0, b1=0.9, b2=0.99, eps=1e-8,
    weight_decay=0.0, grad_clip=1.0, master_dtype="float32", master_rounding="nearest")
SIM_RL = dataclasses.replace(SIM_RL, knobs=tuple(  # a fresh typed None per config
    dataclasses.replace(k, factory=lambda: ml_collections.config_dict.placeholder(float))
    if k.name == "clip_eps_high" else k for k in SIM_RL.knobs))
SFT = _SFT.with_defaults(lr=3e-3, warmup_steps=20, base_dir="")
EVAL_NUM_PROMPTS = dataclasses.replace(_EVAL_NUM_PROMPTS, default=256)
