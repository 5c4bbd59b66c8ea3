"""Accelerator rates: dense tensor throughput per input format, HBM bandwidth and capacity, and
the chip-to-chip interconnect, per chip.

A leaf module: the cost model (lowrl.asyncrl.cost_model) and the memory/FLOP estimator
(lowrl.memory) read their hardware from here; it imports nothing from lowrl. Also how much
memory one device has: `device_memory(name)` is what a `hardware` knob value stands for (a
preset, auto: the backend's report, none), `host_memory()` the RAM this process may use.

Units: TFLOP/s = 1e12 FLOP/s, TB/s = 1e12 bytes/s, GB = 1e9 bytes, GB/s = 1e9 bytes/s.
"""
from __future__ import annotations

import dataclasses
import math
import os

import jax

BF16 = "bf16"
# Matmul input format (lowrl.quant format names, or "bf16") -> the dense tensor rate of the chip
# it runs at.
TENSOR_RATE = {BF16: "bf16", "fp8_e4m3": "fp8", "fp8_e5m2": "fp8", "mxfp8_e4m3": "fp8",
               "mxfp8_e5m2": "fp8", "mxfp4": "fp4", "nvfp4": "fp4"}
PRECISION_FORMATS = tuple(TENSOR_RATE)


def positive_finite(owner: str, **values: float) -> None:
  """Raises ValueError naming `owner.name` for any value that is not a positive finite number."""
  for name, value in values.items():
    if isinstance(value, bool) or not value > 0 or not math.isfinite(value):
      raise ValueError(f"{owner}.{name} must be a positive finite number, got {value!r}.")


@dataclasses.dataclass(frozen=True)
class Hardware:
  """One accelerator chip: dense (no 2:4 sparsity) tensor rates, HBM and interconnect.

  Attributes:
    name: short name (the key in HARDWARE).
    bf16_tflops, fp8_tflops: dense tensor-unit TFLOP/s (on a chip without FP8 units, the rate
      an FP8 matmul gets there, i.e. the BF16 rate).
    fp4_tflops: dense FP4 tensor-core TFLOP/s, None where the chip has no FP4 tensor cores.
    hbm_tbps: HBM bandwidth, TB/s.
    hbm_gb: HBM capacity, GB.
    interconnect_gbps: scale-up interconnect bandwidth per chip, GB/s, bidirectional (NVLink
      through NVSwitch, TPU ICI); None = unknown.
  """

  name: str
  bf16_tflops: float
  fp8_tflops: float
  fp4_tflops: float | None
  hbm_tbps: float
  hbm_gb: float
  interconnect_gbps: float | None = None

  def __post_init__(self):
    positive_finite("Hardware", bf16_tflops=self.bf16_tflops, fp8_tflops=self.fp8_tflops,
                    hbm_tbps=self.hbm_tbps, hbm_gb=self.hbm_gb)
    if self.fp4_tflops is not None:
      positive_finite("Hardware", fp4_tflops=self.fp4_tflops)
    if self.interconnect_gbps is not None:
      positive_finite("Hardware", interconnect_gbps=self.interconnect_gbps)

  @property
  def hbm_bytes(self) -> float:
    """HBM capacity in bytes."""
    return self.hbm_gb * 1e9

  def flops_per_s(self, fmt: str) -> float:
    """Dense tensor FLOP/s of a matmul whose inputs are in `fmt` (a key of TENSOR_RATE).

    FP4 on a chip without FP4 tensor cores runs at the BF16 rate (weight-only FP4 kernels, e.g.
    Marlin in vLLM, dequantize in registers).
    """
    if fmt not in TENSOR_RATE:
      raise ValueError(f"matmul format {fmt!r} has no tensor rate; use one of {PRECISION_FORMATS}.")
    rate = TENSOR_RATE[fmt]
    if rate == "fp4" and self.fp4_tflops is None:
      rate = "bf16"
    return {"bf16": self.bf16_tflops, "fp8": self.fp8_tflops,
            "fp4": self.fp4_tflops}[rate] * 1e12


# NVIDIA's product pages quote tensor rates "with sparsity" (2:4 structured); dense is half.
HARDWARE: dict[str, Hardware] = {
    # H100 SXM: nvidia.com/en-us/data-center/h100 (SXM column: BF16 1,979 and FP8 3,958 TFLOPS
    # "with sparsity", 80 GB, 3.35 TB/s, NVLink 900 GB/s). Dense 989.4 / 1,978.9:
    # glennklockwood.com/garden/processors/h100 (matrix vs sparse columns). No FP4 tensor cores
    # (Hopper).
    "h100_sxm": Hardware("h100_sxm", bf16_tflops=989.5, fp8_tflops=1979.0, fp4_tflops=None,
                         hbm_tbps=3.35, hbm_gb=80.0, interconnect_gbps=900.0),
    # H200 SXM: nvidia.com/en-us/data-center/h200 (same GH100 compute as H100 SXM: BF16 1,979 and
    # FP8 3,958 TFLOPS with sparsity; 141 GB HBM3e at 4.8 TB/s; NVLink 900 GB/s).
    "h200": Hardware("h200", bf16_tflops=989.5, fp8_tflops=1979.0, fp4_tflops=None,
                     hbm_tbps=4.8, hbm_gb=141.0, interconnect_gbps=900.0),
    # B200 (HGX B200, 1,000 W): nvidia.com/en-us/data-center/hgx (per GPU: FP4 18, FP8/FP6 9,
    # FP16/BF16 4.5 PFLOPS with sparsity; 180 GB HBM3e at 7.7 TB/s; fifth-generation NVLink
    # 1.8 TB/s per GPU). Dense 9,000 / 4,500 / 2,250 TFLOPS:
    # glennklockwood.com/garden/processors/B200 (HGX variant, matrix column).
    "b200": Hardware("b200", bf16_tflops=2250.0, fp8_tflops=4500.0, fp4_tflops=9000.0,
                     hbm_tbps=7.7, hbm_gb=180.0, interconnect_gbps=1800.0),
    # TPU v5p, per chip: cloud.google.com/tpu/docs/v5p ("Peak compute per chip (BF16) 459",
    # "(FP8) 459" TFLOPs: no FP8 units, FP8 matmuls run at the BF16 rate; HBM2e 95 GB at
    # 2,765 GB/s; bidirectional ICI 1,200 GB/s per chip). 918 INT8 TOP/s
    # (aiwiki.ai/wiki/google_tpu_v5p) is not modelled. TPU rates are dense (no sparsity factor).
    # One later revision of that page says 95 GiB; the smaller figure (95e9 bytes) is kept so
    # that a fit check errs on the safe side.
    "v5p": Hardware("v5p", bf16_tflops=459.0, fp8_tflops=459.0, fp4_tflops=None,
                    hbm_tbps=2.765, hbm_gb=95.0, interconnect_gbps=1200.0),
}


def hardware(name: str) -> Hardware:
  """HARDWARE[name], with a one-line error listing the known names."""
  if name not in HARDWARE:
    raise ValueError(f"unknown hardware {name!r}; use one of {sorted(HARDWARE)}.")
  return HARDWARE[name]


# The `hardware` knob: a lowrl.hardware preset, "auto" (the backend's reported memory; none on
# CPU) or "none" (no fit check).
AUTO, NO_LIMIT = "auto", "none"
HARDWARE_CHOICES = (AUTO, NO_LIMIT, *sorted(HARDWARE))
GB = 1e9


def device_memory(name: str) -> tuple[float | None, str]:
  """(bytes of one device's memory, where that number comes from) of a `hardware` knob value.

  A preset (HARDWARE_CHOICES): its HBM. "none": (None, ...): no fit check. "auto": the first
  device's `memory_stats()["bytes_limit"]` where the backend reports one (GPU, TPU); on CPU the
  host's RAM (`host_memory`) shared by the local CPU devices; None where a backend reports none.
  """
  if name not in HARDWARE_CHOICES:
    raise ValueError(f"hardware={name!r}; use one of {HARDWARE_CHOICES}.")
  if name == NO_LIMIT:
    return None, "no fit check (hardware=none)"
  if name != AUTO:
    return HARDWARE[name].hbm_bytes, f"{name} HBM"
  device = jax.devices()[0]
  if device.platform == "cpu":
    ram, source = host_memory()
    n = jax.local_device_count()
    return ram / n, f"{source} {ram / GB:.1f} GB / {n} CPU device(s)"
  stats = device.memory_stats() or {}
  if "bytes_limit" not in stats:
    return None, f"no limit ({device.device_kind} reports no memory_stats bytes_limit)"
  return float(stats["bytes_limit"]), f"{device.device_kind} memory_stats bytes_limit"


def host_memory() -> tuple[float, str]:
  """(bytes, what they are) of the RAM this process may use: the machine's physical memory, or
  the cgroup (container) limit where that is smaller."""
  ram, source = float(os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")), "host RAM"
  for path in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
    try:
      with open(path) as f:
        limit = f.read().strip()
    except OSError:
      continue
    if limit.isdigit() and float(limit) < ram:
      ram, source = float(limit), "cgroup memory limit"
  return ram, source
