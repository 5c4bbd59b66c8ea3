r"""Fake-quant (quantize -> dequantize) throughput per format, vs a BF16 round trip and qwix.

  python -m experiments.bench_quant                                  # 4096 x 4096, all formats
  python -m experiments.bench_quant --size=1024 --repeats=9 --formats=nvfp4,mxfp4

For every format, one jitted `fake_quant` of a BF16 [size, size] tensor (activations are BF16),
quantized along the last axis, writing a fresh output buffer. Baselines in the same process:
  * bf16_roundtrip: BF16 -> FP32 (times a runtime 1.0, so XLA cannot fold the casts away) -> BF16
    into a fresh buffer, like the quantizers;
  * bf16_donated: the same round trip with its input donated (the output reuses the buffer: the
    memory floor of an elementwise pass, without the page faults of fresh allocations);
  * qwix (when importable): `qwix.dequantize(qwix.quantize(x, ...))` to the same format where qwix
    has it (no FP8 E5M2 MX, no 4/6, no per-token NVFP4; its NVFP4 has no FP32 tensor scale and its
    MX scales round up, like our default rceil).
All candidates are compiled and run once, then timed round-robin (interleaved, so load changes on a
shared machine hit all of them alike). The table reports medians over --repeats rounds and, for the
ratio to each BF16 round trip, its spread: the ratio is taken per round (both timed within the same
round), then the median and the [min, max] over rounds are printed.

--stages also times, for each spec-exact round-to-nearest NVFP4 format, its first stages as
programs of their own in the same rounds: the block amax alone, and the amax with every per-block
quantity (outer scale, block scales, code thresholds and, with 4/6, the choice between 6 and 4);
the rest of fake_quant is the element pass. Where the time goes, as ratios to the same round trip.

--hlo prints the StableHLO line counts of each format's fake_quant program and of the forward+grad
program of one quantized matmul ([size/8, size] x [size, size/8], lhs per-token, the main job's
NVFP4 recipe: per-token 4/6 activations, 4/6 weights, dequantized backward, BF16 compute) against
the same program unquantized (BF16): the program size that lowering and compilation scale with.
"""
import time

from absl import app, flags
import jax
import jax.numpy as jnp
import numpy as np

from lowrl import user_cache
from lowrl.quant import QDotConfig, QuantConfig, bytes_per_param, fake_quant, nvfp4
from lowrl.quant.layout import abs_max, block_layout, normalize_config
from lowrl.quant.qdot import quantized_dot_general

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
    "nvfp4_pt": QuantConfig("nvfp4", per_token=True),
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
# Targets (issue 29), against the fresh-buffer BF16 round trip.
TARGETS = {"nvfp4_pt_4o6": 4.0, "nvfp4": 2.0}
BASELINES = ("bf16_roundtrip", "bf16_donated")

def _hlo_lines(fn, *args) -> int:
  return len(jax.jit(fn).lower(*args).as_text(debug_info=False).splitlines())


def _print_hlo_sizes(formats: list[str], n: int) -> None:
  """StableHLO lines of each fake_quant program and of one matmul's forward+grad program."""
  x = jax.ShapeDtypeStruct((n, n), jnp.bfloat16)
  print("StableHLO lines:")
  for name in formats:
    cfg, key = FORMATS[name], (jax.random.key(0) if FORMATS[name].stochastic_rounding else None)
    print(f"  fake_quant {name:<14} {_hlo_lines(lambda v, c=cfg, k=key: fake_quant(v, c, k), x)}")
  a = jax.ShapeDtypeStruct((n // 8, n), jnp.bfloat16)
  w = jax.ShapeDtypeStruct((n, n // 8), jnp.float32)
  dn = (((1,), (0,)), ((), ()))
  recipe = QDotConfig(lhs=QuantConfig("nvfp4", per_token=True, four_over_six=True),
                      rhs=QuantConfig("nvfp4", four_over_six=True), backward="dequantized",
                      compute_dtype="bfloat16")
  for label, cfg in (("bf16", QDotConfig(compute_dtype="bfloat16")), ("nvfp4_recipe", recipe)):
    loss = lambda a, w, cfg=cfg: jnp.sum(quantized_dot_general(  # noqa: E731
        a, w, dn, cfg, preferred_element_type=jnp.float32))
    print(f"  qdot fwd+grad {label:<12} {_hlo_lines(jax.value_and_grad(loss, (0, 1)), a, w)}")


def _candidates(formats: list[str], use_qwix: bool) -> dict[str, callable]:
  """name -> jitted function of (x_bf16, one_f32)."""
  roundtrip = lambda x, one: (x.astype(jnp.float32) * one).astype(x.dtype)  # noqa: E731
  fns = {"bf16_roundtrip": jax.jit(roundtrip),
         "bf16_donated": jax.jit(roundtrip, donate_argnums=0)}
  for name in formats:
    cfg = FORMATS[name]
    key = jax.random.key(0) if cfg.stochastic_rounding else None
    fns[name] = jax.jit(lambda x, one, cfg=cfg, key=key: fake_quant(x, cfg, key))
    if use_qwix and name in QWIX_FORMATS:
      kw = QWIX_FORMATS[name]
      fns[f"qwix:{name}"] = jax.jit(lambda x, one, kw=kw: qwix.dequantize(qwix.quantize(x, **kw)))
  return fns


def _stage_candidates(formats: list[str], shape) -> dict[str, callable]:
  """'name/amax' and 'name/scales' programs of the spec-exact round-to-nearest NVFP4 formats."""
  fns = {}
  for name in formats:
    cfg = normalize_config(FORMATS[name], len(shape))
    if cfg.scheme != "nvfp4" or cfg.stochastic_rounding:
      continue
    layout = block_layout(shape, cfg)
    blocked = lambda x, layout=layout: x.reshape(layout.blocked_shape)  # noqa: E731
    fns[f"{name}/amax"] = jax.jit(lambda x, one, layout=layout, b=blocked: abs_max(
        b(x), layout.reduce_axes, paired=True))
    fns[f"{name}/scales"] = jax.jit(lambda x, one, cfg=cfg, layout=layout, b=blocked: nvfp4._scales(
        b(x), cfg, layout, None)[2:])
  return fns


def _time_interleaved(fns: dict, args: tuple, repeats: int,
                      clock=time.perf_counter) -> dict[str, np.ndarray]:
  """Seconds per call of each function per round, measured round-robin after a warm-up call.
  bf16_donated consumes its input: each call gets the previous call's output (same values)."""
  x, one = args
  donated = jnp.array(x, copy=True)
  def call(name, fn):
    nonlocal donated
    if name == "bf16_donated":
      donated = fn(donated, one)
      return donated
    return fn(x, one)
  for name, fn in fns.items():
    jax.block_until_ready(call(name, fn))  # compile
    jax.block_until_ready(call(name, fn))  # warm caches / allocator
  times = {name: [] for name in fns}
  for _ in range(repeats):
    for name, fn in fns.items():
      start = clock()
      jax.block_until_ready(call(name, fn))
      times[name].append(clock() - start)
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
  if _STAGES.value:
    fns.update(_stage_candidates(_FORMATS.value, x.shape))
  clock = time.process_time if _CLOCK.value == "cpu" else time.perf_counter
  times = _time_interleaved(fns, args, _REPEATS.value, clock)
  med = {name: float(np.median(t)) for name, t in times.items()}
  # Per-round ratios to each round trip timed in the same round: median and [min, max].
  ratios = {b: {name: t / times[b] for name, t in times.items()} for b in BASELINES}

  print(f"\nfake_quant of a BF16 [{n}, {n}] tensor on {jax.devices()[0].platform}, "
        f"median of {_REPEATS.value} interleaved runs, {_CLOCK.value} clock"
        + ("" if use_qwix else " (qwix not importable: no qwix column)"))
  for b in BASELINES:
    print(f"{b}: {med[b] * 1e3:.2f} ms (rounds: {np.min(times[b]) * 1e3:.1f}"
          f"-{np.max(times[b]) * 1e3:.1f} ms)")
  header = (f"\n{'format':<14} {'ours ms':>9} {'x fresh rt':>10} {'[min, max]':>14} "
            f"{'x donated':>10} {'[min, max]':>14} {'qwix ms':>9} {'ours/qwix':>10} "
            f"{'bits/param':>11}")
  print(header)
  print("-" * len(header))
  for name in _FORMATS.value:
    ours = med[name]
    q = med.get(f"qwix:{name}")
    qwix_ms = f"{q * 1e3:9.2f}" if q is not None else f"{'n/a':>9}"
    vs_qwix = f"{ours / q:10.2f}" if q is not None else f"{'n/a':>10}"
    bits = 8 * bytes_per_param(FORMATS[name], (n, n))
    cols = ""
    for b in BASELINES:
      r = ratios[b][name]
      cols += f" {np.median(r):10.2f} {f'[{r.min():.2f}, {r.max():.2f}]':>14}"
    print(f"{name:<14} {ours * 1e3:9.2f}{cols} {qwix_ms} {vs_qwix} {bits:11.4f}")

  for name, target in TARGETS.items():
    if name in med:
      ratio = float(np.median(ratios["bf16_roundtrip"][name]))
      verdict = "met" if ratio <= target else "NOT met"
      print(f"target {name} <= {target:g}x fresh bf16 round trip: {ratio:.2f}x ({verdict})")
  for name in _FORMATS.value:
    if f"qwix:{name}" in med:
      r = ratios["bf16_roundtrip"][name] / ratios["bf16_roundtrip"][f"qwix:{name}"]
      print(f"vs qwix {name}: {np.median(r):.2f}x [{r.min():.2f}, {r.max():.2f}]")
  stages = [name for name in fns if "/" in name]
  if stages:
    print("\nstages (x fresh round trip, per-round median [min, max]; the rest is the element pass):")
    for name in stages:
      r = ratios["bf16_roundtrip"][name]
      print(f"  {name:<22} {np.median(r):6.2f} [{r.min():.2f}, {r.max():.2f}]")
  if _HLO.value:
    print()
    _print_hlo_sizes(_FORMATS.value, n)


if __name__ == "__main__":
  # Flags only when run as a binary: the tests import several experiments (one absl flag registry).
  _SIZE = flags.DEFINE_integer("size", 4096, "The tensor is [size, size] BF16.")
  _REPEATS = flags.DEFINE_integer("repeats", 5, "Timed rounds (median reported).")
  _FORMATS = flags.DEFINE_list("formats", list(FORMATS), f"Formats to time, from {list(FORMATS)}.")
  _QWIX = flags.DEFINE_bool("qwix", True, "Also time qwix where it supports the format.")
  _COMPILE_CACHE = user_cache.define_compile_cache_flag()
  _SEED = flags.DEFINE_integer("seed", 0, "PRNG seed of the input tensor.")
  _CLOCK = flags.DEFINE_enum("clock", "wall", ["wall", "cpu"],
                             "wall: time.perf_counter; cpu: time.process_time (CPU seconds of all "
                             "threads of this process, less sensitive to other processes' load).")
  _STAGES = flags.DEFINE_bool("stages", False, "Also time the NVFP4 stages (block amax; all "
                               "per-block work) as programs of their own.")
  _HLO = flags.DEFINE_bool("hlo", True, "Print StableHLO line counts (fake_quant, qdot fwd+grad).")
  app.run(main)
