"""LoRA adapters on a frozen base: which matmuls get one, their parameters, their forward.

A targeted matmul `y = x W` computes `y = base(x, W) + ((x A) B) * alpha / r` (Hu et al. 2021,
"LoRA", eq. 3; PEFT's `lora.Linear.forward`: the base layer's output, bias included, plus
`lora_B(lora_A(x)) * scaling`). `base` is the matmul the precision policy gives it (NVFP4, MXFP8,
FP8, BF16, ...: the adapter does not change it); the adapter's two products take operands in the
adapter's precision (`precision.AdapterPrecision`: FP32 or BF16) and accumulate in FP32. A is
[in, r], B is [r, out] (the kernels' [in, out] orientation; PEFT's `lora_A.weight` is A^T and
`lora_B.weight` B^T, `lowrl.checkpoints.peft` converts).

Where the adapters live: next to the kernel they adapt, `params[...]["q_proj"]["lora_a"]` and
`["lora_b"]`, so every forward (trainer, sampler, calibration, scanned layers) reads them with the
params it already gets and `QDense` adds the product when they are present (`adapter_delta`). The
base is frozen by the update (`lowrl.training.lora_update`: gradients and optimizer state of the
adapters only). `split` / `merge` move between the combined tree and (base, adapters).

Initialisation (PEFT's default, `init_lora_weights=True`): A ~ U(-1/sqrt(in), 1/sqrt(in)) (torch's
kaiming_uniform_ with a = sqrt(5)), B = 0, so step 0 computes exactly the base: the added term is
a sum of zeros (test_lora.py checks the logits bit for bit).

No dropout: PEFT's lora_dropout on the adapter's input would make the trainer's forward random,
and RL's importance ratio compares two forwards of the same tokens (exact mode: the sampler's and
the trainer's, bit for bit); the PEFT export writes lora_dropout = 0.
"""
from __future__ import annotations

import dataclasses
import math
import re
from typing import Any

import jax
import jax.numpy as jnp

from lowrl.models import layout
from lowrl.models.config import ModelConfig
from lowrl.precision import AdapterPrecision, PrecisionPolicy

Params = Any
A, B = "lora_a", "lora_b"  # the adapter leaves next to a kernel
ADAPTER_DTYPES = ("float32", "bfloat16")
# PEFT's "all-linear" on Llama/Qwen: every linear layer of the blocks, the LM head excluded.
ALL_LINEAR = r"layers_\d+/(attn/(q|k|v|o)_proj|mlp/(gate|up|down)_proj)"


@dataclasses.dataclass(frozen=True)
class LoraConfig:
  """A LoRA run's adapters (the `lora` config section; rank 0 = full fine-tuning, no adapters).

  Attributes:
    rank: r, the adapters' inner width.
    alpha: the output is scaled by alpha / r (PEFT's lora_alpha).
    targets: regex fullmatched against the matmuls' full paths (`layers_3/attn/q_proj`,
      `lm_head`), like the precision policy's rules.
    dtype: the adapter products' operand precision (float32 | bfloat16; FP32 accumulation).
    packed_base: the trainer holds the base's quantized kernels packed (codes + scales, quantized
      once at load: lowrl.training.lora_update.pack_base), not in the master dtype.
  """

  rank: int
  alpha: float
  targets: str = ALL_LINEAR
  dtype: str = "float32"
  packed_base: bool = False

  @property
  def scale(self) -> float:
    return self.alpha / self.rank

  @property
  def precision(self) -> AdapterPrecision:
    return AdapterPrecision(scale=self.scale, compute_dtype=self.dtype)


def config_from(section: Any) -> LoraConfig | None:
  """The LoraConfig of a validated `lora` section, None when `rank` is 0 (off)."""
  if not section.rank:
    return None
  return LoraConfig(rank=int(section.rank), alpha=float(section.alpha),
                    targets=section.targets, dtype=section.dtype,
                    packed_base=bool(section.get("packed_base", False)))


def targets(cfg: LoraConfig, model_cfg: ModelConfig) -> tuple[layout.Matmul, ...]:
  """The matmuls of `model_cfg` that get an adapter, in execution order."""
  return tuple(m for m in layout.matmuls(model_cfg) if re.fullmatch(cfg.targets, m.full_path))


def check(cfg: LoraConfig, model_cfg: ModelConfig) -> tuple[layout.Matmul, ...]:
  """The targeted matmuls; ValueError naming the `--config.lora.*` flag for a rank or target
  that cannot apply (before anything compiles)."""
  if cfg.rank < 1:
    raise ValueError(f"--config.lora.rank={cfg.rank}: must be >= 1 (0 = no adapters).")
  if not cfg.alpha > 0:
    raise ValueError(f"--config.lora.alpha={cfg.alpha}: must be > 0 (the output scale is "
                     "alpha / rank).")
  if cfg.dtype not in ADAPTER_DTYPES:
    raise ValueError(f"--config.lora.dtype={cfg.dtype!r}: use one of {ADAPTER_DTYPES}.")
  try:
    re.compile(cfg.targets)
  except re.error as e:
    raise ValueError(f"--config.lora.targets={cfg.targets!r} is not a valid regex: {e}.") from None
  hit = targets(cfg, model_cfg)
  if not hit:
    raise ValueError(f"--config.lora.targets={cfg.targets!r} matches no matmul; paths look like "
                     f"{layout.matmuls(model_cfg)[0].full_path!r} or 'lm_head' (fullmatch).")
  for m in hit:
    if not m.owns_kernel:
      raise ValueError(f"--config.lora.targets matches {m.full_path!r}, a head tied to the "
                       "embedding (no kernel of its own to adapt); exclude it from the regex.")
    if m.n_experts:
      raise ValueError(f"--config.lora.targets matches {m.full_path!r}: adapters on stacked "
                       "routed experts are not implemented; exclude mlp/experts/ from the regex.")
    if cfg.rank > min(m.in_features, m.out_features):
      raise ValueError(f"--config.lora.rank={cfg.rank} exceeds {m.full_path}'s "
                       f"min(in, out) = {min(m.in_features, m.out_features)}: the adapter "
                       "would not be low-rank; lower the rank or narrow --config.lora.targets.")
  return hit


def adapter_policy(policy: PrecisionPolicy, cfg: LoraConfig | None) -> PrecisionPolicy:
  """`policy` with the adapters' precision (the forward then adds the adapters it finds)."""
  return policy if cfg is None else dataclasses.replace(policy, adapter=cfg.precision)


def num_params(cfg: LoraConfig, model_cfg: ModelConfig) -> int:
  """Adapter parameters: r (in + out) per targeted matmul."""
  return sum(cfg.rank * (m.in_features + m.out_features) for m in targets(cfg, model_cfg))


def _module_keys(m: layout.Matmul) -> tuple[str, ...]:
  return m.param_keys[:-1]  # ("layers_0", "attn", "q_proj")


def init_adapters(cfg: LoraConfig, model_cfg: ModelConfig, key: jax.Array,
                  dtype=jnp.float32) -> Params:
  """The adapter tree ({layers_i: {attn: {q_proj: {lora_a, lora_b}}}}): A ~ U(+-1/sqrt(in)),
  B = 0; matmul j's A draws from fold_in(key, j), deterministic in `key`."""
  out: dict = {}
  for j, m in enumerate(check(cfg, model_cfg)):
    bound = 1.0 / math.sqrt(m.in_features)
    a = jax.random.uniform(jax.random.fold_in(key, j), (m.in_features, cfg.rank), jnp.float32,
                           -bound, bound).astype(dtype)
    b = jnp.zeros((cfg.rank, m.out_features), dtype)
    _put(out, _module_keys(m), {A: a, B: b})
  return out


def adapter_shapes(cfg: LoraConfig, model_cfg: ModelConfig, dtype=jnp.float32) -> Params:
  """ShapeDtypeStructs of `init_adapters`'s tree."""
  return jax.eval_shape(lambda: init_adapters(cfg, model_cfg, jax.random.key(0), dtype))


def _put(tree: dict, keys: tuple[str, ...], value: Any) -> None:
  for k in keys[:-1]:
    tree = tree.setdefault(k, {})
  tree[keys[-1]] = value


def merge(base: Params, adapters: Params) -> Params:
  """The combined tree: `base` with each adapter's leaves added next to its kernel."""
  if not isinstance(adapters, dict):
    return adapters
  out = dict(base)
  for k, v in adapters.items():
    out[k] = merge(base[k], v) if k in base else v
  return out


def split(params: Params) -> tuple[Params, Params]:
  """(base, adapters) of a combined tree; inverse of `merge`."""
  base, adapters = {}, {}
  for k, v in params.items():
    if k in (A, B):
      adapters[k] = v
    elif isinstance(v, dict):
      b, a = split(v)
      base[k] = b
      if a:
        adapters[k] = a
    else:
      base[k] = v
  return base, adapters


def has_adapters(params: Params) -> bool:
  return bool(split(params)[1]) if isinstance(params, dict) else False


def adapter_delta(x: jax.Array, a: jax.Array, b: jax.Array, spec: AdapterPrecision
                  ) -> jax.Array:
  """((x A) B) * scale, FP32: both products on `spec.compute_dtype` operands, FP32 accumulation
  (x A rounded to that dtype before the second product, as a BF16 PEFT adapter computes it)."""
  dt = jnp.dtype(spec.compute_dtype)
  xa = jnp.einsum("...i,ir->...r", x.astype(dt), a.astype(dt),
                  preferred_element_type=jnp.float32)
  y = jnp.einsum("...r,ro->...o", xa.astype(dt), b.astype(dt),
                 preferred_element_type=jnp.float32)
  return y * jnp.float32(spec.scale)


def merged_kernels(params: Params, scale: float) -> Params:
  """The base tree with every adapted kernel replaced by W + A B * scale (FP32 products; in the
  kernel's dtype): the merged model, for export and as the autodiff reference."""
  base, adapters = split(params)

  def walk(b, a):
    if A in a:
      w = b["kernel"]
      delta = jnp.matmul(a[A].astype(jnp.float32), a[B].astype(jnp.float32)) * scale
      return {**b, "kernel": (w.astype(jnp.float32) + delta).astype(w.dtype)}
    return {k: walk(b[k], a[k]) if k in a else b[k] for k in b}

  return walk(base, adapters)


def tree_bytes(tree: Params) -> int:
  """Bytes of a tree's array leaves (what a weight sync of it moves)."""
  return int(sum(x.size * jnp.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree)))
