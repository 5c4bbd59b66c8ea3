"""Precision policy: which quantizer (QDotConfig) each matmul of the decoder uses.

A policy is built from an `ml_collections.ConfigDict` (one flag per knob, so an ablation is one
command-line override, e.g. `--config.precision.bf16_last_fraction=0`) and the model's matmuls
(`lowrl.models.layout.matmuls(model_cfg)`, passed in: this module sits below the model and
imports nothing from it), into a frozen, hashable `PrecisionPolicy`: an ordered list of
`(regex, QDotConfig)` rules over matmul paths, first match wins (big_vision / haliax style). The
paths are the layout's full paths (`layers_{i}/attn/q_proj`, ..., `layers_{i}/mlp/down_proj`,
`lm_head`); regexes are matched with `re.fullmatch`.

Everything that is not a linear layer (embedding lookup, norms, RoPE, attention math, softmax,
KV cache) runs in `compute_dtype` (softmax, norms, logits and log-softmax in FP32) and is not
governed by the rules.
"""
from __future__ import annotations

import dataclasses
import re
from typing import NamedTuple, Protocol, Sequence

import jax
import jax.numpy as jnp
import ml_collections

from lowrl import recipes
from lowrl.quant.config import (BACKWARD_MODES, COMPUTE_DTYPES, FORMATS, GEMMS, NATIVE_FORMATS,
                                QDotConfig, QuantConfig)

FORMAT_NONE = "none"
STOCHASTIC_ROUNDING_MODES = ("none", "grad", "all")
# The named recipes; their values are data in lowrl/recipes.py (`recipe`).
RECIPES = tuple(recipes.RECIPES)
# Mixture-of-experts matmuls by name (regexes over full paths, lowrl/models/layout.py): the routed
# experts' stacked kernels, the shared expert's MLP, and the routers (the top-k router and the
# shared expert's sigmoid gate). Routers are never quantized by `format`: make_policy gives them
# an FP32 GEMM (BF16: name them in `high_precision_paths`; quantized: `prepend_rules`).
ROUTED_EXPERTS = r"layers_\d+/mlp/experts/.*"
SHARED_EXPERT = r"layers_\d+/mlp/shared_expert/.*"
ROUTER = r"layers_\d+/mlp/(router|shared_expert_gate)"
# Per-tensor weight scales of the matmuls an engine fuses (`models.layout.FUSED_GROUPS`): "fused"
# = one scale from the group's joint amax (what vLLM's fused linear reads), "per_linear" = each
# weight its own.
WEIGHT_SCALES = ("fused", "per_linear")
# Activation formats: "" = the weight format (W4A4, W8A8, ...); "none" = activations stay in the
# compute dtype (weight-only quantization, e.g. W4A16).
ACT_FORMATS = ("", FORMAT_NONE)
# What the attention's KV cache stores (lowrl.models.kv_cache): the compute dtype, FP8 E4M3 with
# static per-tensor or per-head scales, or NVFP4 blocks along head_dim.
KV_CACHE_MODES = ("none", "fp8_per_tensor", "fp8_per_head", "nvfp4")


class MatmulSite(Protocol):
  """What a policy needs to know of a matmul (`lowrl.models.layout.Matmul` is one)."""

  layer: int | None  # decoder layer; None for the LM head
  path: str  # "attn/q_proj", ..., "lm_head"

  @property
  def full_path(self) -> str: ...  # what the rules match, e.g. "layers_3/mlp/up_proj"


def _head(matmuls: Sequence[MatmulSite]) -> MatmulSite:
  heads = [m for m in matmuls if m.layer is None]
  if len(heads) != 1:
    raise ValueError(f"expected exactly one matmul outside the layers (the LM head), got {heads}.")
  return heads[0]


def _num_layers(matmuls: Sequence[MatmulSite]) -> int:
  return 1 + max((m.layer for m in matmuls if m.layer is not None), default=-1)


def _alternation(paths: Sequence[str]) -> str:
  """A regex that fullmatches exactly `paths`."""
  return "|".join(re.escape(p) for p in paths)


def bf16_tail_layers(n_layers: int, fraction: float) -> tuple[int, ...]:
  """The last round(fraction * n_layers) layers, at least one when fraction > 0."""
  if fraction <= 0:
    return ()
  n = min(n_layers, max(1, round(fraction * n_layers)))
  return tuple(range(n_layers - n, n_layers))


@dataclasses.dataclass(frozen=True)
class AdapterPrecision:
  """How the low-rank adapters of a LoRA run compute (lowrl.models.lora): `(x A) B * scale`
  with both products taking `compute_dtype` operands and accumulating in FP32.

  Attributes:
    scale: alpha / rank.
    compute_dtype: "float32" or "bfloat16" (the adapter's precision, whatever the base's).
  """

  scale: float
  compute_dtype: str = "float32"

  def __post_init__(self):
    if self.compute_dtype not in ("float32", "bfloat16"):
      raise ValueError(f"adapter compute_dtype={self.compute_dtype!r}; use float32 or bfloat16.")


@dataclasses.dataclass(frozen=True)
class PrecisionPolicy:
  """Frozen matmul-path -> QDotConfig map (a static argument of jitted model functions).

  Attributes:
    rules: ((regex, QDotConfig), ...); the first regex that fullmatches a path wins.
    compute_dtype: dtype of activations, attention math and the KV cache ("float32",
      "bfloat16" or "float16").
    name: the recipe name, for logs.
    weight_scales: "fused" (default): the weights of matmuls an inference engine fuses
      (`models.layout.FUSED_GROUPS`: q/k/v, gate/up) whose quantizers are equal and have a
      per-tensor scale (FP8, NVFP4) take one per-tensor scale from their joint amax, so the
      engine's fused linear holds the values the policy computes; "per_linear": each its own.
    kv_cache: what the KV cache stores, one of KV_CACHE_MODES ("none": compute_dtype); a
      quantized cache reads static K/V scales (lowrl.models.kv_cache).
    adapter: how LoRA adapters found in the params compute (None: a tree with adapters is an
      error; lowrl.models.lora.adapter_policy sets it).
  """

  rules: tuple[tuple[str, QDotConfig], ...]
  compute_dtype: str = "float32"
  name: str = ""
  weight_scales: str = "fused"
  kv_cache: str = "none"
  adapter: AdapterPrecision | None = None

  def __post_init__(self):
    if self.compute_dtype not in COMPUTE_DTYPES:
      raise ValueError(f"compute_dtype={self.compute_dtype!r}; use one of {COMPUTE_DTYPES}.")
    if self.weight_scales not in WEIGHT_SCALES:
      raise ValueError(f"weight_scales={self.weight_scales!r}; use one of {WEIGHT_SCALES}.")
    if self.kv_cache not in KV_CACHE_MODES:
      raise ValueError(f"kv_cache={self.kv_cache!r}: use one of {', '.join(KV_CACHE_MODES)} "
                       "(--config.sampler_precision.kv_cache).")
    for pattern, cfg in self.rules:
      try:
        re.compile(pattern)
      except re.error as e:
        raise ValueError(f"Invalid rule regex {pattern!r}: {e}.") from e
      if not isinstance(cfg, QDotConfig):
        raise ValueError(f"Rule {pattern!r} maps to {cfg!r}; rules map to QDotConfig objects "
                         "(QDotConfig(compute_dtype=...) for an unquantized matmul).")

  @classmethod
  def unquantized(cls, matmuls: Sequence[MatmulSite], compute_dtype: str = "float32",
                  name: str = "") -> PrecisionPolicy:
    """Every matmul plain, in `compute_dtype`; the LM head in FP32."""
    return cls(rules=((_alternation([_head(matmuls).full_path]),
                       QDotConfig(compute_dtype="float32")),
                      (".*", QDotConfig(compute_dtype=compute_dtype))),
               compute_dtype=compute_dtype, name=name or compute_dtype)

  @property
  def dtype(self) -> jnp.dtype:
    return jnp.dtype(self.compute_dtype)

  def qdot_config(self, full_path: str) -> QDotConfig:
    """The QDotConfig of the matmul at `full_path` ("layers_0/attn/q_proj", ..., "lm_head")."""
    full = full_path
    for pattern, cfg in self.rules:
      if re.fullmatch(pattern, full):
        return cfg
    raise ValueError(f"No precision rule matches matmul {full!r}; end the rules with a "
                     "catch-all ('.*', QDotConfig(...)).")

  def act_paths(self, matmuls: Sequence[MatmulSite], scaling: str) -> tuple[str, ...]:
    """Full paths of `matmuls` whose activation scaling (`activation_scaling`) is `scaling`, in
    order. "tensor": the keys a static calibrated `act_amax` tree must hold for this policy to
    decode row-locally; "tile": 2-D activation blocks (spanning 16 tokens), which no sampler can
    reproduce token by token, with or without static scales."""
    if scaling not in ACT_SCALINGS:
      raise ValueError(f"scaling={scaling!r}; use one of {ACT_SCALINGS}.")
    return tuple(m.full_path for m in matmuls
                 if activation_scaling(self.qdot_config(m.full_path)) == scaling)

  @property
  def needs_key(self) -> bool:
    """True when some quantizer rounds stochastically (the forward then needs a quant_key)."""
    return any(q is not None and q.stochastic_rounding
               for _, c in self.rules for q in (c.lhs, c.rhs, c.grad))

  def quant_key(self, key: jax.Array | None) -> jax.Array | None:
    """`key` when some quantizer rounds stochastically, else None (a forward without one then
    takes no key: the same program whatever key the caller holds)."""
    return key if self.needs_key else None


ACT_SCALINGS = ("none", "row", "tensor", "tile")


def activation_scaling(cfg: QDotConfig) -> str:
  """What the activation (lhs) scale of a matmul depends on (docs/reference.md §2, per-tensor).

  "none": activations unquantized. "row": every scale is computed within one token's row (MX
  blocks or NVFP4 blocks along the contracting axis with a per-token outer scale): causal and
  independent of the other rows, so a decoder reproduces it token by token. "tensor": one scale
  over the whole tensor (per-tensor FP8, NVFP4 without per_token): non-causal and batch-dependent
  when computed from the data; row-local only with a static (calibrated) amax. "tile": 2-D blocks
  spanning several tokens: never row-local.
  """
  q = cfg.lhs
  if q is None:
    return "none"
  if q.block_2d:
    return "tile"
  if q.kind == "mx" or q.per_token:
    return "row"
  return "tensor"


# ----------------------------------------------------------------------------------------------
# Config -> policy.


# The knobs of a precision section, each overridable alone (`--config.precision.KNOB=...`), and
# their meanings. The values of the named recipes are data: lowrl/recipes.py (a base recipe that
# spells out every knob, the others as their changes to it).
KNOBS = {
    "name": "label of the recipe in the precision table and logs (the values are the other knobs)",
    "format": "'none' or a lowrl.quant format (nvfp4, mxfp8_e4m3, ...) for the linear layers",
    "act_format": "activations: '' = quantized with `format`; 'none' = weight-only (activations in "
                  "compute_dtype, e.g. W4A16)",
    "compute_dtype": "activations / attention / KV cache / unquantized GEMM dtype",
    "backward": "high_precision | dequantized | quantized (QDotConfig.backward)",
    "grad_format": "gradient quantizer format when backward=quantized ('' = same as format)",
    "act_per_token": "NVFP4 activations get one FP32 outer scale per token",
    "four_over_six": "NVFP4 4/6 block scaling (activations and weights)",
    "weight_block_2d": "NVFP4 16x16 weight blocks",
    "scale_rounding": "MX scale rounding: rceil | floor",
    "stochastic_rounding": "none | grad (gradient quantizer) | all (every quantizer)",
    "rht_wgrad": "random Hadamard transform on the weight-gradient GEMM (backward=quantized)",
    "bf16_last_fraction": "the last round(f * n_layers) layers (>= 1 if f > 0) run unquantized in "
                          "compute_dtype; 0 disables",
    "quantize_lm_head": "quantize the LM head with `format` too (default: unquantized)",
    "lm_head_dtype": "GEMM dtype of an unquantized LM head (logits are FP32 regardless)",
    "high_precision_paths": "regex (fullmatch) of further matmul paths kept unquantized, '' = none",
    "gemm": "emulated (dequantized operands in compute_dtype) | native (FP8 formats: the codes as "
            "float8 GEMM operands, what XLA lowers to cuBLASLt FP8 GEMMs; forward only)",
    "weight_scales": "fused (q/k/v and gate/up share one per-tensor weight scale, as inference "
                     "engines fuse them) | per_linear",
}


def recipe(name: str) -> ml_collections.ConfigDict:
  """A fresh precision ConfigDict of the named recipe (one of RECIPES): every knob of KNOBS, with
  the values of lowrl/recipes.py."""
  if name not in RECIPES:
    raise ValueError(f"Unknown precision recipe {name!r}; use one of {RECIPES}.")
  return ml_collections.ConfigDict(dict(recipes.RECIPES[name]))


def _check_config(c: ml_collections.ConfigDict) -> None:
  """Raises ValueError, naming the flag to change, for unknown names and out-of-range values."""
  formats = (FORMAT_NONE, *sorted(FORMATS))
  if c.format not in formats:
    raise ValueError(f"precision.format={c.format!r}; use one of {formats}.")
  if c.compute_dtype not in COMPUTE_DTYPES:
    raise ValueError(f"precision.compute_dtype={c.compute_dtype!r}; use one of {COMPUTE_DTYPES}.")
  if c.gemm not in GEMMS:
    raise ValueError(f"precision.gemm={c.gemm!r}; use one of {GEMMS}.")
  if c.act_format not in ACT_FORMATS:
    raise ValueError(f"precision.act_format={c.act_format!r}; use '' (activations in "
                     "precision.format) or 'none' (weight-only).")
  if c.weight_scales not in WEIGHT_SCALES:
    raise ValueError(f"precision.weight_scales={c.weight_scales!r}; use one of {WEIGHT_SCALES}.")
  if c.act_format == FORMAT_NONE:
    if c.act_per_token:
      raise ValueError("precision.act_per_token=True scales quantized activations, but "
                       "precision.act_format='none' leaves them unquantized; set "
                       "precision.act_per_token=False or precision.act_format=''.")
    if c.gemm == "native":
      raise ValueError("precision.gemm=native multiplies two FP8 operands, but "
                       "precision.act_format='none' leaves the activations unquantized; set "
                       "precision.gemm=emulated.")
  if c.gemm == "native" and c.format not in NATIVE_FORMATS:
    raise ValueError(f"precision.gemm=native needs an FP8 precision.format {NATIVE_FORMATS} (got "
                     f"{c.format!r}); set precision.gemm=emulated.")
  if c.lm_head_dtype not in COMPUTE_DTYPES:
    raise ValueError(f"precision.lm_head_dtype={c.lm_head_dtype!r}; use one of {COMPUTE_DTYPES}.")
  if c.backward not in BACKWARD_MODES:
    raise ValueError(f"precision.backward={c.backward!r}; use one of {BACKWARD_MODES}.")
  if c.stochastic_rounding not in STOCHASTIC_ROUNDING_MODES:
    raise ValueError(f"precision.stochastic_rounding={c.stochastic_rounding!r}; use one of "
                     f"{STOCHASTIC_ROUNDING_MODES}.")
  if not 0.0 <= c.bf16_last_fraction <= 1.0:
    raise ValueError(f"precision.bf16_last_fraction={c.bf16_last_fraction} must be in [0, 1] "
                     "(0 disables the high-precision tail).")
  if c.grad_format and c.grad_format not in FORMATS:
    raise ValueError(f"precision.grad_format={c.grad_format!r}; use '' (same as format) or one of "
                     f"{sorted(FORMATS)}.")
  try:
    re.compile(c.high_precision_paths)
  except re.error as e:
    raise ValueError(f"precision.high_precision_paths={c.high_precision_paths!r} is not a valid "
                     f"regex: {e}.") from e
  quantized = c.format != FORMAT_NONE
  if not quantized:
    for knob in ("act_per_token", "four_over_six", "weight_block_2d", "quantize_lm_head",
                 "rht_wgrad"):
      if c[knob]:
        raise ValueError(f"precision.{knob}=True needs a quantized format; set "
                         f"precision.format (e.g. nvfp4) or precision.{knob}=False.")
    if c.stochastic_rounding != "none":
      raise ValueError("precision.stochastic_rounding needs a quantized format; set "
                       "precision.format or precision.stochastic_rounding=none.")
    if c.backward != "high_precision":
      raise ValueError(f"precision.backward={c.backward!r} needs a quantized format; set "
                       "precision.format or precision.backward=high_precision.")
    return
  if FORMATS[c.format][1] != "nvfp4":
    for knob in ("act_per_token", "four_over_six", "weight_block_2d"):
      if c[knob]:
        raise ValueError(f"precision.{knob} is an NVFP4 option but precision.format="
                         f"{c.format!r}; set precision.format=nvfp4 or precision.{knob}=False.")
  if c.backward != "quantized":
    if c.stochastic_rounding == "grad":
      raise ValueError("precision.stochastic_rounding=grad rounds the gradient quantizer, which "
                       "only backward=quantized has; set precision.backward=quantized or "
                       "precision.stochastic_rounding=none.")
    if c.rht_wgrad:
      raise ValueError("precision.rht_wgrad needs precision.backward=quantized.")
    if c.grad_format:
      raise ValueError("precision.grad_format needs precision.backward=quantized; set it to ''.")


def _quantized_qdot(c: ml_collections.ConfigDict) -> QDotConfig:
  nvfp4 = FORMATS[c.format][1] == "nvfp4"
  sr_fwd = c.stochastic_rounding == "all"
  lhs = None if c.act_format == FORMAT_NONE else QuantConfig(
      c.format, scale_rounding=c.scale_rounding, stochastic_rounding=sr_fwd,
      per_token=nvfp4 and c.act_per_token, four_over_six=nvfp4 and c.four_over_six)
  rhs = QuantConfig(c.format, scale_rounding=c.scale_rounding, stochastic_rounding=sr_fwd,
                    block_2d=nvfp4 and c.weight_block_2d, four_over_six=nvfp4 and c.four_over_six)
  grad = None
  if c.backward == "quantized":
    grad = QuantConfig(c.grad_format or c.format, scale_rounding=c.scale_rounding,
                       stochastic_rounding=c.stochastic_rounding != "none")
  return QDotConfig(lhs=lhs, rhs=rhs, backward=c.backward, grad=grad, rht_wgrad=c.rht_wgrad,
                    compute_dtype=c.compute_dtype, gemm=c.gemm)


def make_policy(config: ml_collections.ConfigDict,
                matmuls: Sequence[MatmulSite]) -> PrecisionPolicy:
  """Builds the frozen policy of a precision ConfigDict for a model's `matmuls`.

  Rule order (first match wins): high-precision tail layers, `high_precision_paths`, LM head,
  every other linear layer. Whether the block formats tile the model's widths (and shards) is
  checked by `lowrl.quant_blocks.check_quant_blocks`, the one block check.

  Raises:
    ValueError: unknown names, out-of-range values or knobs that need another knob; the message
      names the flag to change.
  """
  c = config
  missing = [k for k in KNOBS if k not in c]
  if missing:
    raise ValueError(f"precision config lacks {missing}; start from a named recipe "
                     "(lowrl/recipes.py) or lowrl.precision.recipe(name).")
  unknown = [k for k in c if k not in KNOBS]
  if unknown:
    raise ValueError(f"precision config has unknown knobs {unknown}; the knobs are {list(KNOBS)}.")
  _check_config(c)
  plain = QDotConfig(compute_dtype=c.compute_dtype)
  quant = _quantized_qdot(c) if c.format != FORMAT_NONE else plain
  rules: list[tuple[str, QDotConfig]] = []
  if quant.quantized:
    tail = bf16_tail_layers(_num_layers(matmuls), c.bf16_last_fraction)
    if tail:
      rules.append((_alternation([m.full_path for m in matmuls if m.layer in tail]), plain))
  if c.high_precision_paths:
    rules.append((c.high_precision_paths, plain))
  head = quant if c.quantize_lm_head else QDotConfig(compute_dtype=c.lm_head_dtype)
  rules.append((_alternation([_head(matmuls).full_path]), head))
  if any(re.fullmatch(ROUTER, m.full_path) for m in matmuls):  # MoE models only
    rules.append((ROUTER, QDotConfig(compute_dtype="float32")))
  rules.append((".*", quant))
  return PrecisionPolicy(rules=tuple(rules), compute_dtype=c.compute_dtype, name=c.name,
                         weight_scales=c.weight_scales)


def prepend_rules(policy: PrecisionPolicy, rules: Sequence[tuple[str, QDotConfig]],
                  name: str | None = None) -> PrecisionPolicy:
  """`policy` with `rules` matched first (e.g. a quantized router: ((ROUTER, qdot_config),))."""
  return PrecisionPolicy(rules=tuple(rules) + policy.rules, compute_dtype=policy.compute_dtype,
                         name=policy.name if name is None else name)


def policy_for(name: str, matmuls: Sequence[MatmulSite], **overrides) -> PrecisionPolicy:
  """`make_policy(recipe(name) with overrides, matmuls)`: the one-liner for tests and scripts."""
  c = recipe(name)
  for k, v in overrides.items():
    if k not in c:
      raise ValueError(f"Unknown precision knob {k!r}; knobs are {sorted(c.keys())}.")
    c[k] = v
  return make_policy(c, matmuls)


# ----------------------------------------------------------------------------------------------
# The assignment table.


class Assignment(NamedTuple):
  layer: int | None  # None for the LM head
  path: str  # "attn/q_proj", ..., "lm_head"
  fmt: str  # quantizer format ("nvfp4", "lhs/rhs" when they differ) or the GEMM dtype
  backward: str  # QDotConfig.backward, "-" for unquantized matmuls (plain autodiff)
  options: str  # quantizer options, comma-separated ("" when none)


def _options(cfg: QDotConfig) -> str:
  opts = []
  if cfg.lhs is not None and cfg.lhs.per_token:
    opts.append("act_per_token")
  if any(q is not None and q.four_over_six for q in (cfg.lhs, cfg.rhs)):
    opts.append("four_over_six")
  if cfg.rhs is not None and cfg.rhs.block_2d:
    opts.append("weight_block_2d")
  if any(q is not None and q.kind == "mx" and q.scale_rounding != "rceil"
         for q in (cfg.lhs, cfg.rhs)):
    opts.append("scale_floor")
  if any(q is not None and q.stochastic_rounding for q in (cfg.lhs, cfg.rhs)):
    opts.append("sr")
  if cfg.grad is not None:
    opts.append(f"grad={cfg.grad.fmt}" + ("+sr" if cfg.grad.stochastic_rounding else ""))
  if cfg.rht_wgrad:
    opts.append("rht_wgrad")
  if cfg.quantized:
    opts.append(f"gemm={cfg.compute_dtype}")
  if cfg.gemm == "native":
    opts.append("native_gemm")
  return ",".join(opts)


def assignment_table(policy: PrecisionPolicy,
                     matmuls: Sequence[MatmulSite]) -> list[Assignment]:
  """What each of `matmuls` runs in under `policy`, in their order."""
  rows = []
  for m in matmuls:
    layer, path = m.layer, m.path
    cfg = policy.qdot_config(m.full_path)
    if not cfg.quantized:
      fmt, backward = cfg.compute_dtype, "-"
    else:
      names = [q.fmt if q is not None else cfg.compute_dtype for q in (cfg.lhs, cfg.rhs)]
      fmt = names[0] if names[0] == names[1] else "/".join(names)
      backward = cfg.backward
    rows.append(Assignment(layer, path, fmt, backward, _options(cfg)))
  return rows


def format_table(rows: list[Assignment]) -> str:
  """The table as text, consecutive layers with identical assignments merged (for logs)."""
  lines = [f"{'layers':<10} {'matmul':<14} {'format':<12} {'backward':<15} options"]
  by_layer: dict[int | None, list[Assignment]] = {}
  for r in rows:
    by_layer.setdefault(r.layer, []).append(r)
  groups: list[tuple[list[int | None], list[Assignment]]] = []
  for layer, rs in by_layer.items():
    key = [r[1:] for r in rs]
    if groups and layer is not None and groups[-1][0][-1] is not None and \
        [r[1:] for r in groups[-1][1]] == key:
      groups[-1][0].append(layer)
    else:
      groups.append(([layer], rs))
  for layers, rs in groups:
    name = "-" if layers[0] is None else (
        str(layers[0]) if len(layers) == 1 else f"{layers[0]}-{layers[-1]}")
    for r in rs:
      lines.append(f"{name:<10} {r.path:<14} {r.fmt:<12} {r.backward:<15} {r.options}")
  return "\n".join(lines)
