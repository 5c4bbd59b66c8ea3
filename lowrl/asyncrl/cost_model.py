"""Throughput and cost model of an asynchronous RL system: how long sampling, training and weight
sync take on real accelerators, and the staleness, throughput and GPU-hours that follow.

Units: seconds, bytes, FLOPs. Notation: N = `ModelSize.n_params` (the weights the matmuls of one
forward read: decoder blocks + LM head; an untied input embedding is a gather and is left out),
Nq = the decoder blocks' linear weights (what a recipe quantizes), of which a fraction f stays in
BF16 (`Precision.bf16_fraction`, nvfp4_recipe's tail layers), L layers, q = H·hd (query width),
kv = K·hd (key/value width), B sequences per trainer step, P prompt and H generated tokens each.

  weight bytes    W(p) = (1-f)·Nq·bytes(p) + (N - (1-f)·Nq)·2      (the rest is stored in BF16)
  KV cache        kvt  = 2·L·kv·kv_bytes bytes per token           (K and V of every layer)
  matmul FLOPs    2 per weight per token forward, twice that backward (Kaplan et al. 2020);
                  (1-f)·Nq of them run at the dense tensor rate of the format, the rest at BF16
  attention FLOPs 4·L·q·c for a token attending to c keys (QK^T and AV; softmax ignored), BF16;
                  a causal sequence of T tokens: sum over c = 1..T = 2·L·q·T(T+1)
  compute time    sum_i FLOPs_i / (rate_i · mfu)
  memory time     bytes / (hbm · hbm_efficiency)
  roofline        a kernel takes max(compute time, memory time); tp devices split both evenly
                  (tensor-parallel communication is not modelled)

Sampler: R = sampler_devices / sampler_tp replicas, each holding `rows` sequences.
  prefill   = roofline(rows·(2N·P + 2·L·q·P(P+1)),  W + rows·P·kvt)         (compute-bound)
  decode j  = roofline(rows·(2N + 4·L·q·(P+j)),     W + rows·(P+j)·kvt)     (memory-bound)
              for j = 1..H-1 (the first completion token comes from the prefill's logits)
  generate  = prefill + sum_j decode j            (every sequence runs to the horizon H)
Trainer: trainer_devices in data parallel (perfect scaling, memory not checked). Per sequence of
T = P + H tokens the forward is F = 2N·T + 2·L·q·T(T+1) FLOPs;
  train step = B·[epochs·(F at the forward precision + 2F at the backward precision)
                  + F (pi_old recompute, if recompute_old_logp)] / (trainer_devices · mfu)
Weight sync: sync = W(sampler precision) / (sampler_tp · sync_gbps), each device of a replica
receiving its shard over its own link; the samplers stall for it once every sync_every steps.

Steady state (samplers and trainer run concurrently, one batch per trainer step). The replicas
keep k batches in flight, rows = max(k·B/R, 1) each (the average load; a replica holds at least
one sequence). A batch's generation latency is G(k) = generate(rows) and the samplers deliver one
batch every
  period(k) = G(k)/k + sync/sync_every.
k is the smallest number of batches that keeps the trainer busy (period(k) <= train step), capped
by sampler memory (W + rows·(P+H)·kvt <= sampler_tp·hbm_gb) and by `max_in_flight`; at the cap
the samplers are the bottleneck. Uncapped, a sampler-bound pool fills its memory, so more sampler
devices add batches in flight (throughput) and lag; at a fixed max_in_flight (prime-rl's async
level) more sampler devices never raise the lag.
  step      = max(train step, period(k))
  lag_steps = G(k) / step       (trainer steps that happen while a batch is generated)
  lag       = ceil(lag_steps) >= 1   (updates between the version that samples a batch and the one
                                      that consumes it: `AsyncSchedule(lag=lag)`)
  samples/s = B / step;   GPU-hours per step = (sampler_devices + trainer_devices)·step / 3600
  synchronous step = generate(max(B/R, 1)) + sync + train step   (same devices, no overlap, lag 0)

Precision on chips without FP4 tensor cores (Hopper): FP4 weights are still stored in 4 bits (the
memory-bound decode gains), but the matmuls run at the BF16 rate (weight-only W4A16 kernels, e.g.
Marlin in vLLM, dequantize in registers).

Matmul rates (`Cluster.rates`): "measured" (default) takes, where this project measured them,
the achieved rate relative to BF16 on that chip (MEASURED_RATE_VS_BF16: Hopper has no block-scaled
GEMM, so MXFP8 through lax.scaled_dot runs at ~0.9x BF16, per-tensor FP8 at ~1.25x on MLP shapes,
not the datasheet's 2x); elsewhere, and with rates="datasheet", the chip's dense datasheet rate of
the format (lowrl.hardware: B200 FP8 2x, FP4 4x BF16).
"""
from __future__ import annotations

import dataclasses
import math

import ml_collections
import numpy as np

from lowrl import precision as precision_lib
# The hardware rates live in lowrl.hardware (shared with the memory/FLOP estimator); re-exported.
from lowrl.hardware import BF16, HARDWARE, PRECISION_FORMATS, Hardware  # noqa: F401
from lowrl.hardware import TENSOR_RATE as _TENSOR_RATE
from lowrl.hardware import positive_finite as _positive
from lowrl.quant.config import FORMATS, QuantConfig
from lowrl.quant.packing import bytes_per_param

RATE_SOURCES = ("measured", "datasheet")
_HOPPER = ("h100_sxm", "h200")  # one GH100 compute die: the H200 measurement holds for both
# Achieved matmul rate / BF16 rate, measured on one H200 (docs/benchmarks.md "FP8 and MXFP8
# GEMMs", `python -m experiments.bench_gemm`, medians at the Llama/Qwen MLP shapes): per-tensor
# FP8 E4M3 1.21-1.29x (1.25 taken), MXFP8 E4M3 via lax.scaled_dot 0.87-0.94x (0.90 taken).
MEASURED_RATE_VS_BF16 = {
    **{(hw, fmt): 1.25 for hw in _HOPPER for fmt in ("fp8_e4m3", "fp8_e5m2")},
    **{(hw, fmt): 0.90 for hw in _HOPPER for fmt in ("mxfp8_e4m3", "mxfp8_e5m2")},
}


def matmul_flops_per_s(hw: Hardware, fmt: str, rates: str = "measured") -> float:
  """Dense FLOP/s of a matmul in `fmt` on `hw`: the measured ratio to BF16 where there is one
  (rates="measured", MEASURED_RATE_VS_BF16), else the datasheet rate (Hardware.flops_per_s)."""
  if rates not in RATE_SOURCES:
    raise ValueError(f"rates={rates!r}; use one of {RATE_SOURCES}.")
  ratio = MEASURED_RATE_VS_BF16.get((hw.name, fmt)) if rates == "measured" else None
  return hw.flops_per_s(fmt) if ratio is None else ratio * hw.flops_per_s(BF16)


# Storage per weight is measured on a 4096 x 4096 kernel (its per-tensor scales are negligible).
_REFERENCE_KERNEL = (4096, 4096)


def _positive_int(owner: str, **values: int) -> None:
  for name, value in values.items():
    if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value < 1:
      raise ValueError(f"{owner}.{name} must be a positive int, got {value!r}.")


@dataclasses.dataclass(frozen=True)
class Precision:
  """What a recipe costs: the format of the quantized matmuls and of their backward.

  Attributes:
    fmt: "bf16" or a lowrl.quant format ("mxfp8_e4m3", "nvfp4", ...) of the decoder blocks' linear
      layers (weights stored in it, matmuls at its tensor rate).
    bf16_fraction: fraction of those weights kept in BF16 (nvfp4_recipe's BF16 tail layers).
    backward_fmt: format the backward (gradient) matmuls run in; "bf16" unless backward="quantized".
  """

  fmt: str = BF16
  bf16_fraction: float = 0.0
  backward_fmt: str = BF16

  def __post_init__(self):
    for name in ("fmt", "backward_fmt"):
      if getattr(self, name) not in _TENSOR_RATE:
        raise ValueError(f"Precision.{name}={getattr(self, name)!r}; use one of "
                         f"{PRECISION_FORMATS}.")
    if not 0.0 <= self.bf16_fraction <= 1.0:
      raise ValueError(f"Precision.bf16_fraction must be in [0, 1], got {self.bf16_fraction}.")

  @property
  def bytes_per_weight(self) -> float:
    """Storage of one quantized weight, scales included (lowrl.quant.packing.bytes_per_param)."""
    if self.fmt == BF16:
      return 2.0
    return bytes_per_param(QuantConfig(self.fmt), _REFERENCE_KERNEL)


def precision_of(config: ml_collections.ConfigDict, n_layers: int) -> Precision:
  """The cost-model Precision of a lowrl precision ConfigDict (`lowrl.precision.recipe(name)`).

  The BF16 tail is the recipe's own (`lowrl.precision.bf16_tail_layers`) on an n_layers model.
  """
  _positive_int("precision_of", n_layers=n_layers)
  if config.format == precision_lib.FORMAT_NONE:
    if config.compute_dtype not in ("bfloat16", "float16"):
      raise ValueError(f"precision compute_dtype={config.compute_dtype!r} has no tensor rate in "
                       "the cost model; use bfloat16 or float16.")
    fmt = BF16
  elif config.format in FORMATS:
    fmt = config.format
  else:
    raise ValueError(f"precision format={config.format!r}; use 'none' or one of {sorted(FORMATS)}.")
  if config.quantize_lm_head or config.high_precision_paths:
    raise ValueError("the cost model quantizes exactly the decoder blocks' linear layers; unset "
                     "quantize_lm_head / high_precision_paths or build a Precision directly.")
  tail = precision_lib.bf16_tail_layers(n_layers, config.bf16_last_fraction)
  backward_fmt = BF16
  if fmt != BF16 and config.backward == "quantized":
    grad_fmt = config.grad_format or fmt
    # A GEMM of two formats runs at the rate of the wider one.
    backward_fmt = max(fmt, grad_fmt, key=lambda f: Precision(f).bytes_per_weight)
  return Precision(fmt, len(tail) / n_layers if fmt != BF16 else 0.0, backward_fmt)


@dataclasses.dataclass(frozen=True)
class ModelSize:
  """The sizes the cost model needs.

  Attributes:
    n_params: weights the matmuls of one forward read (N: blocks + LM head).
    n_quantizable: of those, the decoder blocks' linear weights (Nq: what a recipe quantizes).
    n_layers: decoder blocks L.
    q_dim: query width H·hd (attention FLOPs).
    kv_dim: key/value width K·hd (KV cache).
  """

  n_params: int
  n_quantizable: int
  n_layers: int
  q_dim: int
  kv_dim: int

  def __post_init__(self):
    _positive_int("ModelSize", n_params=self.n_params, n_quantizable=self.n_quantizable,
                  n_layers=self.n_layers, q_dim=self.q_dim, kv_dim=self.kv_dim)
    if self.n_quantizable > self.n_params:
      raise ValueError(f"ModelSize.n_quantizable={self.n_quantizable} exceeds "
                       f"n_params={self.n_params}.")

  @classmethod
  def from_model_config(cls, cfg) -> ModelSize:
    """From a lowrl ModelConfig: N counts the embedding only when tied (it is then the LM head)."""
    d = cfg.d_model
    blocks = cfg.n_layers * (2 * d * cfg.q_dim + 2 * d * cfg.kv_dim + 3 * d * cfg.d_ff)
    return cls(n_params=cfg.num_params(include_embedding=cfg.tie_embeddings),
               n_quantizable=blocks, n_layers=cfg.n_layers, q_dim=cfg.q_dim, kv_dim=cfg.kv_dim)


@dataclasses.dataclass(frozen=True)
class Workload:
  """One trainer step's data.

  Attributes:
    batch: sequences per trainer step B (num_prompts × group_size).
    prompt_len: prompt tokens P per sequence.
    horizon: generated tokens H per sequence (max_new_tokens; every sequence runs to it).
    epochs: optimizer passes over each batch (PPO epochs mu).
    recompute_old_logp: the trainer re-scores the batch for pi_old (one more forward).
    sync_every: the samplers receive new weights every sync_every trainer steps.
  """

  batch: int
  prompt_len: int
  horizon: int
  epochs: int = 1
  recompute_old_logp: bool = True
  sync_every: int = 1

  def __post_init__(self):
    _positive_int("Workload", batch=self.batch, prompt_len=self.prompt_len,
                  horizon=self.horizon, epochs=self.epochs, sync_every=self.sync_every)


@dataclasses.dataclass(frozen=True)
class Cluster:
  """Devices and efficiency knobs.

  Attributes:
    hardware: the accelerator (HARDWARE[name]) of both pools.
    sampler_devices, trainer_devices: devices in each pool.
    sampler_tp: devices per sampler replica (tensor parallel); divides sampler_devices.
    mfu: fraction of the dense tensor rate the matmuls reach.
    hbm_efficiency: fraction of the HBM bandwidth the reads reach.
    sync_gbps: weight-sync link bandwidth per device, GB/s (50 = a 400 Gb/s NIC).
    kv_bytes: bytes per cached K or V element (2 = BF16).
    max_in_flight: most batches the samplers may have in flight (None = what memory holds).
    rates: "measured" (this project's measured matmul rates where it has them) or "datasheet"
      (`matmul_flops_per_s`).
  """

  hardware: Hardware
  sampler_devices: int
  trainer_devices: int
  sampler_tp: int = 1
  mfu: float = 0.4
  hbm_efficiency: float = 0.8
  sync_gbps: float = 50.0
  kv_bytes: float = 2.0
  max_in_flight: int | None = None
  rates: str = "measured"

  def __post_init__(self):
    if self.rates not in RATE_SOURCES:
      raise ValueError(f"Cluster.rates={self.rates!r}; use one of {RATE_SOURCES}.")
    _positive_int("Cluster", sampler_devices=self.sampler_devices,
                  trainer_devices=self.trainer_devices, sampler_tp=self.sampler_tp)
    _positive("Cluster", sync_gbps=self.sync_gbps, kv_bytes=self.kv_bytes)
    for name in ("mfu", "hbm_efficiency"):
      if not 0.0 < getattr(self, name) <= 1.0:
        raise ValueError(f"Cluster.{name} must be in (0, 1], got {getattr(self, name)}.")
    if self.sampler_devices % self.sampler_tp:
      raise ValueError(f"Cluster.sampler_tp={self.sampler_tp} must divide "
                       f"sampler_devices={self.sampler_devices}.")
    if self.max_in_flight is not None:
      _positive_int("Cluster", max_in_flight=self.max_in_flight)

  @property
  def sampler_replicas(self) -> int:
    return self.sampler_devices // self.sampler_tp


@dataclasses.dataclass(frozen=True)
class SteadyState:
  """The pipelined system's steady state (module docstring, "Steady state")."""

  in_flight: int              # batches the samplers keep in flight (k)
  rows_per_replica: float     # sequences each sampler replica decodes at once
  prefill_s: float            # prefill of those rows
  generate_s: float           # G(k): a batch's generation latency
  sync_s: float               # one weight sync
  sampler_period_s: float     # G(k)/k + sync/sync_every
  train_step_s: float
  step_s: float               # max(train step, sampler period)
  lag_steps: float            # G(k) / step
  lag: int                    # ceil(lag_steps)
  bottleneck: str             # "trainer" or "sampler"
  samples_per_s: float
  gpu_hours_per_step: float
  synchronous_step_s: float   # the same devices without overlap (lag 0)


@dataclasses.dataclass(frozen=True)
class CostModel:
  """Times of one RL system (module docstring for every formula)."""

  model: ModelSize
  workload: Workload
  cluster: Cluster
  sampler: Precision = Precision()
  trainer: Precision = Precision()

  # ---- building blocks
  def _quantized_weights(self, p: Precision) -> float:
    return (1.0 - p.bf16_fraction) * self.model.n_quantizable if p.fmt != BF16 else 0.0

  def weight_bytes(self, p: Precision) -> float:
    """W(p): every matmul weight, the quantized ones in p's format and the rest in BF16."""
    nq = self._quantized_weights(p)
    return nq * p.bytes_per_weight + (self.model.n_params - nq) * 2.0

  @property
  def kv_bytes_per_token(self) -> float:
    return 2.0 * self.model.n_layers * self.model.kv_dim * self.cluster.kv_bytes

  def _matmul_compute_s(self, weight_flops: float, p: Precision, fmt: str) -> float:
    """Seconds for `weight_flops` FLOPs per weight, the quantized weights' share at fmt's rate."""
    hw = self.cluster.hardware
    nq = self._quantized_weights(p)
    rest = self.model.n_params - nq
    return weight_flops * (nq / matmul_flops_per_s(hw, fmt, self.cluster.rates)
                           + rest / hw.flops_per_s(BF16))

  def _attention_compute_s(self, key_token_pairs: float) -> float:
    """Seconds for 4·L·q FLOPs per (query token, key) pair, in BF16."""
    m = self.model
    return 4.0 * m.n_layers * m.q_dim * key_token_pairs / self.cluster.hardware.flops_per_s(BF16)

  def _sampler_roofline_s(self, compute_s: float | np.ndarray, bytes_read: float | np.ndarray):
    c = self.cluster
    compute = compute_s / (c.mfu * c.sampler_tp)
    memory = bytes_read / (c.hardware.hbm_tbps * 1e12 * c.hbm_efficiency * c.sampler_tp)
    return np.maximum(compute, memory)

  # ---- sampler
  def prefill_s(self, rows: float) -> float:
    """One replica's prefill of `rows` prompts of P tokens."""
    p, prompt = self.sampler, self.workload.prompt_len
    compute = (self._matmul_compute_s(2.0 * rows * prompt, p, p.fmt)
               + self._attention_compute_s(rows * prompt * (prompt + 1) / 2.0))
    return float(self._sampler_roofline_s(compute, self.weight_bytes(p)
                                  + rows * prompt * self.kv_bytes_per_token))

  def decode_step_s(self, rows: float, context: int | np.ndarray):
    """One replica's decode step of `rows` sequences, each attending to `context` keys."""
    p = self.sampler
    compute = self._matmul_compute_s(2.0 * rows, p, p.fmt) + self._attention_compute_s(
        rows * np.asarray(context, np.float64))
    out = self._sampler_roofline_s(compute, self.weight_bytes(p)
                           + rows * np.asarray(context, np.float64) * self.kv_bytes_per_token)
    return float(out) if np.ndim(out) == 0 else out

  def generate_s(self, rows: float) -> float:
    """Prefill + the H-1 decode steps (contexts P+1 .. P+H-1) of one replica holding `rows`."""
    w = self.workload
    contexts = w.prompt_len + np.arange(1, w.horizon, dtype=np.float64)
    return self.prefill_s(rows) + float(np.sum(self.decode_step_s(rows, contexts)))

  def sync_s(self) -> float:
    """One weight sync: the sampler-precision weights over each device's link."""
    c = self.cluster
    return self.weight_bytes(self.sampler) / (c.sampler_tp * c.sync_gbps * 1e9)

  # ---- trainer
  def train_step_s(self) -> float:
    """One trainer step over B sequences of P + H tokens (data parallel over trainer_devices)."""
    w, c, p = self.workload, self.cluster, self.trainer
    tokens = w.prompt_len + w.horizon
    seq_tokens, pairs = w.batch * tokens, w.batch * tokens * (tokens + 1) / 2.0
    forward = self._matmul_compute_s(2.0 * seq_tokens, p, p.fmt) + self._attention_compute_s(pairs)
    backward = (self._matmul_compute_s(4.0 * seq_tokens, p, p.backward_fmt)
                + 2.0 * self._attention_compute_s(pairs))
    total = w.epochs * (forward + backward) + (forward if w.recompute_old_logp else 0.0)
    return total / (c.trainer_devices * c.mfu)

  # ---- the pipeline
  def max_rows_per_replica(self) -> float:
    """Sequences of P + H tokens whose KV cache fits next to the weights in one replica."""
    c, w = self.cluster, self.workload
    free = c.sampler_tp * c.hardware.hbm_gb * 1e9 - self.weight_bytes(self.sampler)
    if free <= 0:
      raise ValueError(f"the sampler weights ({self.weight_bytes(self.sampler) / 1e9:.1f} GB) do "
                       f"not fit in {c.sampler_tp} x {c.hardware.hbm_gb:g} GB: raise "
                       "Cluster.sampler_tp.")
    return free / ((w.prompt_len + w.horizon) * self.kv_bytes_per_token)

  def steady_state(self) -> SteadyState:
    """Solves the pipeline (module docstring, "Steady state")."""
    c, w = self.cluster, self.workload
    replicas = c.sampler_replicas
    per_batch_rows = w.batch / replicas
    max_rows = self.max_rows_per_replica()
    if max(per_batch_rows, 1.0) > max_rows:
      raise ValueError(f"one batch's KV cache ({per_batch_rows:.1f} sequences of "
                       f"{w.prompt_len + w.horizon} tokens per replica) does not fit next to the "
                       f"weights (room for {max_rows:.1f}): raise Cluster.sampler_devices or "
                       "sampler_tp.")
    k_cap = max(1, math.floor(max_rows / per_batch_rows))
    if c.max_in_flight is not None:
      k_cap = min(k_cap, c.max_in_flight)
    sync, train = self.sync_s(), self.train_step_s()

    def rows_of(k: int) -> float:
      return max(k * per_batch_rows, 1.0)

    def period(k: int) -> float:  # non-increasing in k (module docstring)
      return self.generate_s(rows_of(k)) / k + sync / w.sync_every

    if period(k_cap) > train:
      k = k_cap
    else:  # smallest k with period(k) <= train
      lo, hi = 1, k_cap
      while lo < hi:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if period(mid) <= train else (mid + 1, hi)
      k = lo
    rows = rows_of(k)
    generate = self.generate_s(rows)
    sampler_period = generate / k + sync / w.sync_every
    step = max(train, sampler_period)
    lag_steps = generate / step
    devices = c.sampler_devices + c.trainer_devices
    return SteadyState(
        in_flight=k, rows_per_replica=rows, prefill_s=self.prefill_s(rows), generate_s=generate,
        sync_s=sync, sampler_period_s=sampler_period, train_step_s=train, step_s=step,
        lag_steps=lag_steps, lag=max(1, math.ceil(lag_steps - 1e-9)),
        bottleneck="trainer" if train >= sampler_period else "sampler",
        samples_per_s=w.batch / step, gpu_hours_per_step=devices * step / 3600.0,
        synchronous_step_s=self.generate_s(rows_of(1)) + sync + train)
