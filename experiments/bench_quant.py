r"""Fake-quant (quantize -> dequantize) throughput per format, vs a BF16 round trip and qwix.

  python -m experiments.bench_quant                                  # 4096 x 4096, all formats
  python -m experiments.bench_quant --size=1024 --repeats=9 --formats=nvfp4,mxfp4

For every format, one jitted `fake_quant` of a BF16 [size, size] tensor (activations are BF16),
quantized along the last axis. Baselines in the same process:
  * bf16_roundtrip: BF16 -> FP32 (times a runtime 1.0, so XLA cannot fold the casts away) -> BF16,
    the memory-bound floor of any elementwise pass over the tensor;
  * qwix (when importable): `qwix.dequantize(qwix.quantize(x, ...))` to the same format where qwix
    has it (no FP8 E5M2 MX, no 4/6, no per-token NVFP4; its NVFP4 has no FP32 tensor scale and its
    MX scales round up, like our default rceil).
All candidates are compiled and run once, then timed round-robin (interleaved, so load changes on a
shared machine hit all of them alike). The table reports medians over --repeats rounds and, for the
ratio to the BF16 round trip, its spread: the ratio is taken per round (both timed within the same
round), then the median and the [min, max] over rounds are printed.
"""
import time

from absl import app, flags
import jax
import jax.numpy as jnp
import numpy as np

from lowrl import user_cache
from lowrl.quant import QuantConfig, bytes_per_param, fake_quant

try:  # qwix is an optional peer for the comparison only.
  import qwix
except ImportError:  # pragma: no cover - depends on the environment
  qwix = None

FORMATS = {
    "fp8_e4m3": QuantConfig("fp8_e4m3"),
    "fp8_e5m2": QuantConfig("fp8_e5m2"),
    "mxfp8_e4m3": QuantConfig("mxfp8_e4m3"),
    "mxfp8_e5m2": QuantConfig("mxfp8_e5m2"),
    "mxfp4": QuantConfig("mxfp4"),
    "nvfp4": QuantConfig("nvfp4"),
    "nvfp4_pt_4o6": QuantConfig("nvfp4", per_token=True, four_over_six=True),
    "nvfp4_te": QuantConfig("nvfp4", scale_convention="te"),
    "nvfp4_sr": QuantConfig("nvfp4", stochastic_rounding=True),
}
# qwix.quantize keyword arguments of the same format (quantized along axis 1), where it exists.
QWIX_FORMATS = {
    "fp8_e4m3": dict(qtype=jnp.float8_e4m3fn),
    "fp8_e5m2": dict(qtype=jnp.float8_e5m2),
    "mxfp8_e4m3": dict(qtype="mxfp8", tiled_axes={1: 32}),
    "mxfp4": dict(qtype="mxfp4", tiled_axes={1: 32}),
    "nvfp4": dict(qtype="nvfp4", tiled_axes={1: 16}),
}
# Target from the issue: NVFP4 fake-quant within 3x of the BF16 round trip, and faster than qwix.
TARGET_RATIO = 3.0

_SIZE = flags.DEFINE_integer("size", 4096, "The tensor is [size, size] BF16.")
_REPEATS = flags.DEFINE_integer("repeats", 5, "Timed rounds (median reported).")
_FORMATS = flags.DEFINE_list("formats", list(FORMATS), f"Formats to time, from {list(FORMATS)}.")
_QWIX = flags.DEFINE_bool("qwix", True, "Also time qwix where it supports the format.")
_COMPILE_CACHE = user_cache.define_compile_cache_flag()
_SEED = flags.DEFINE_integer("seed", 0, "PRNG seed of the input tensor.")


def _candidates(formats: list[str], use_qwix: bool) -> dict[str, callable]:
  """name -> jitted function of (x_bf16, one_f32)."""
  fns = {"bf16_roundtrip": jax.jit(lambda x, one: (x.astype(jnp.float32) * one).astype(x.dtype))}
  for name in formats:
    cfg = FORMATS[name]
    key = jax.random.key(0) if cfg.stochastic_rounding else None
    fns[name] = jax.jit(lambda x, one, cfg=cfg, key=key: fake_quant(x, cfg, key))
    if use_qwix and name in QWIX_FORMATS:
      kw = QWIX_FORMATS[name]
      fns[f"qwix:{name}"] = jax.jit(lambda x, one, kw=kw: qwix.dequantize(qwix.quantize(x, **kw)))
  return fns


def _time_interleaved(fns: dict, args: tuple, repeats: int) -> dict[str, np.ndarray]:
  """Seconds per call of each function per round, measured round-robin after a warm-up call."""
  for fn in fns.values():
    jax.block_until_ready(fn(*args))  # compile
    jax.block_until_ready(fn(*args))  # warm caches / allocator
  times = {name: [] for name in fns}
  for _ in range(repeats):
    for name, fn in fns.items():
      start = time.perf_counter()
      jax.block_until_ready(fn(*args))
      times[name].append(time.perf_counter() - start)
  return {name: np.asarray(t) for name, t in times.items()}


def main(argv):
  del argv
  user_cache.enable_compile_cache()
  unknown = sorted(set(_FORMATS.value) - set(FORMATS))
  if unknown:
    raise app.UsageError(f"Unknown formats {unknown}; choose from {list(FORMATS)}.")
  use_qwix = _QWIX.value and qwix is not None
  n = _SIZE.value
  x = (jax.random.normal(jax.random.key(_SEED.value), (n, n), jnp.float32) * 2).astype(jnp.bfloat16)
  args = (x, jnp.float32(1.0))
  fns = _candidates(_FORMATS.value, use_qwix)
  times = _time_interleaved(fns, args, _REPEATS.value)
  med = {name: float(np.median(t)) for name, t in times.items()}
  base = med["bf16_roundtrip"]
  # Per-round ratios to the round trip timed in the same round: median and [min, max].
  ratios = {name: t / times["bf16_roundtrip"] for name, t in times.items()}

  print(f"\nfake_quant of a BF16 [{n}, {n}] tensor on {jax.devices()[0].platform}, "
        f"median of {_REPEATS.value} interleaved runs"
        + ("" if use_qwix else " (qwix not importable: no qwix column)"))
  print(f"bf16 round trip: {base * 1e3:.2f} ms (rounds: {np.min(times['bf16_roundtrip']) * 1e3:.1f}"
        f"-{np.max(times['bf16_roundtrip']) * 1e3:.1f} ms)\n")
  header = (f"{'format':<14} {'ours ms':>9} {'x bf16 rt':>10} {'[min, max]':>14} {'qwix ms':>9} "
            f"{'ours/qwix':>10} {'bits/param':>11}")
  print(header)
  print("-" * len(header))
  for name in _FORMATS.value:
    ours = med[name]
    q = med.get(f"qwix:{name}")
    qwix_ms = f"{q * 1e3:9.2f}" if q is not None else f"{'n/a':>9}"
    vs_qwix = f"{ours / q:10.2f}" if q is not None else f"{'n/a':>10}"
    bits = 8 * bytes_per_param(FORMATS[name], (n, n))
    r = ratios[name]
    spread = f"[{r.min():.2f}, {r.max():.2f}]"
    print(f"{name:<14} {ours * 1e3:9.2f} {np.median(r):10.2f} {spread:>14} {qwix_ms} {vs_qwix} "
          f"{bits:11.4f}")

  if "nvfp4" in med:
    ratio = float(np.median(ratios["nvfp4"]))
    verdict = "met" if ratio <= TARGET_RATIO else "NOT met"
    line = f"\ntarget NVFP4 <= {TARGET_RATIO:g}x bf16 round trip: {ratio:.2f}x ({verdict})"
    if "qwix:nvfp4" in med:
      faster = med["nvfp4"] < med["qwix:nvfp4"]
      vs = med["nvfp4"] / med["qwix:nvfp4"]
      line += f"; vs qwix nvfp4: {vs:.2f}x ({'faster' if faster else 'slower'})"
    print(line)


if __name__ == "__main__":
  app.run(main)
