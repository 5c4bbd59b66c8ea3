r"""FP8 vs BF16 GEMM throughput, and one train step under precision.gemm=native vs emulated.

  python -m experiments.bench_gemm                  # GPU sizes: 4096^3 and Qwen/Llama MLP shapes
  python -m experiments.bench_gemm --small          # tiny sizes and the tiny model (CPU, seconds)
  python -m experiments.bench_gemm --sizes=8192x4096x12288 --repeats=9 --step_format=mxfp8_e4m3

GEMMs (M x K x N: [M, K] @ [K, N], FP32 accumulation and output), on the default backend:
  * bf16: BF16 operands (the baseline);
  * fp8: per-tensor FP8 codes (E4M3 x E4M3) as float8 dot operands, the FP32 output times one
    scale: the form XLA's GEMM rewriter lowers to a cuBLASLt FP8 GEMM (lowrl.quant.qdot's native
    path, quantization done ahead of the timing);
  * mxfp8: MXFP8 E4M3 codes with E8M0 block scales through `lax.scaled_dot` (a block-scaled GEMM
    where the backend has one, e.g. Blackwell; elsewhere XLA's decomposition: BF16 dequantization
    + a BF16 GEMM).
Train step: one jitted step (forward, backward, Adam) of --model on [--batch, --seq_len] random
tokens under the --recipe recipe with precision.format=--step_format, gemm=native vs emulated.

Each candidate is timed against its baseline in the same process, interleaved round by round
(load changes hit both alike): a round times --iters calls of each (after a compile and a warm-up
call); the reported ratio is baseline time / candidate time per round (> 1: the candidate is
faster), its median and [min, max] over --repeats rounds. TFLOP/s are medians (2 M K N per GEMM).
On CPU the numbers only show that the programs run: XLA CPU has no FP8 GEMM and upcasts.
GPU numbers of one H200 run (GEMMs only) are in docs/benchmarks.md.
"""
from __future__ import annotations

import dataclasses
import json
import time
from typing import Callable

from absl import app, flags
import jax
import jax.numpy as jnp
import numpy as np
import optax

from lowrl import precision, user_cache
from lowrl.models import config as model_config
from lowrl.models import init, layout, logprobs
from lowrl.quant import QuantConfig, quantize

GPU_SIZES = ("4096x4096x4096", "8192x4096x12288", "8192x12288x4096", "8192x8192x28672")
SMALL_SIZES = ("64x64x64", "128x64x96")



@dataclasses.dataclass(frozen=True)
class Comparison:
  """One candidate against its baseline: seconds per call (medians) and the per-round ratios."""

  name: str
  baseline: str
  baseline_s: float
  candidate_s: float
  ratios: tuple[float, ...]  # baseline / candidate per round (> 1: candidate faster)
  flops: float = 0.0  # per call (0: not a GEMM)

  @property
  def ratio(self) -> float:
    return float(np.median(self.ratios))

  def row(self) -> str:
    tf = lambda s: f"{self.flops / s / 1e12:11.2f}" if self.flops else f"{'-':>11}"  # noqa: E731
    return (f"{self.name:<36}{self.baseline:<10}{self.baseline_s * 1e3:11.3f}"
            f"{self.candidate_s * 1e3:11.3f}{tf(self.baseline_s)}{tf(self.candidate_s)}"
            f"{self.ratio:8.2f}  [{min(self.ratios):.2f}, {max(self.ratios):.2f}]")


HEADER = (f"{'candidate':<36}{'baseline':<10}{'base ms':>11}{'cand ms':>11}{'base TF/s':>11}"
          f"{'cand TF/s':>11}{'ratio':>8}  [min, max]")


def _round_s(fn: Callable, args: tuple, iters: int) -> float:
  """Seconds per call over `iters` calls (dispatched back to back, then waited for)."""
  t0 = time.perf_counter()
  out = None
  for _ in range(iters):
    out = fn(*args)
  jax.block_until_ready(out)
  return (time.perf_counter() - t0) / iters


def compare(name: str, baseline: str, base: tuple[Callable, tuple],
            cand: tuple[Callable, tuple], *, repeats: int, iters: int,
            flops: float = 0.0) -> Comparison:
  """Times `cand` against `base` ((jitted fn, args) each), interleaved over `repeats` rounds."""
  for fn, args in (base, cand):
    jax.block_until_ready(fn(*args))  # compile and warm up
  base_s, cand_s = [], []
  for _ in range(repeats):
    base_s.append(_round_s(*base, iters))
    cand_s.append(_round_s(*cand, iters))
  return Comparison(name, baseline, float(np.median(base_s)), float(np.median(cand_s)),
                    tuple(b / c for b, c in zip(base_s, cand_s)), flops)


def parse_size(text: str) -> tuple[int, int, int]:
  """"MxKxN" -> (M, K, N), with a one-line error naming the flag."""
  try:
    m, k, n = (int(v) for v in text.lower().split("x"))
    if min(m, k, n) < 1:
      raise ValueError
  except ValueError:
    raise ValueError(f"--sizes entry {text!r}: use MxKxN with positive ints, e.g. "
                     "4096x4096x4096.") from None
  return m, k, n


def gemm_comparisons(m: int, k: int, n: int, *, repeats: int, iters: int,
                     seed: int = 0) -> list[Comparison]:
  """FP8 (per-tensor) and MXFP8 GEMMs of [m, k] @ [k, n] against the BF16 GEMM."""
  ka, kb = jax.random.split(jax.random.key(seed))
  a = jax.random.normal(ka, (m, k), jnp.float32)
  b = jax.random.normal(kb, (k, n), jnp.float32)
  dn = (((1,), (0,)), ((), ()))
  bf16 = jax.jit(lambda x, y: jax.lax.dot_general(x, y, dn, preferred_element_type=jnp.float32))
  base = (bf16, (a.astype(jnp.bfloat16), b.astype(jnp.bfloat16)))
  flops = 2.0 * m * k * n
  out = []
  qa, qb = quantize(a, QuantConfig("fp8_e4m3")), quantize(b, QuantConfig("fp8_e4m3"))
  fp8 = jax.jit(lambda x, y, s: jax.lax.dot_general(x, y, dn, preferred_element_type=jnp.float32)
                * s)
  out.append(compare(f"fp8_e4m3 {m}x{k}x{n}", "bf16", base,
                     (fp8, (qa.codes, qb.codes, qa.scale * qb.scale)),
                     repeats=repeats, iters=iters, flops=flops))
  if k % 32 == 0:
    ma = quantize(a, QuantConfig("mxfp8_e4m3", axis=1))
    mb = quantize(b, QuantConfig("mxfp8_e4m3", axis=0))
    mx = jax.jit(lambda x, y, sx, sy: jax.lax.scaled_dot(
        x, y, lhs_scale=sx, rhs_scale=sy, dimension_numbers=dn,
        preferred_element_type=jnp.float32))
    out.append(compare(f"mxfp8_e4m3 {m}x{k}x{n}", "bf16", base,
                       (mx, (ma.codes, mb.codes, ma.scale, mb.scale)),
                       repeats=repeats, iters=iters, flops=flops))
  return out


def train_step_comparison(model: str, batch: int, seq_len: int, recipe: str, fmt: str, *,
                          repeats: int, iters: int, seed: int = 0) -> Comparison:
  """One jitted train step (forward + backward + Adam) under gemm=native vs emulated."""
  cfg = model_config.preset(model, max_seq_len=max(seq_len, 2))
  matmuls = layout.matmuls(cfg)
  tx = optax.adam(1e-4)
  params = init.init_params(cfg, jax.random.key(seed))
  opt_state = tx.init(params)
  tokens = jax.random.randint(jax.random.key(seed + 1), (batch, seq_len), 0, cfg.vocab_size)

  def step_of(gemm: str):
    policy = precision.policy_for(recipe, matmuls, format=fmt, gemm=gemm)

    def step(params, opt_state, tokens):
      loss_fn = lambda p: -jnp.mean(logprobs.token_logprobs(p, tokens, cfg, policy))  # noqa: E731
      loss, grads = jax.value_and_grad(loss_fn)(params)
      updates, opt_state = tx.update(grads, opt_state, params)
      return optax.apply_updates(params, updates), opt_state, loss

    return jax.jit(step)

  args = (params, opt_state, tokens)
  return compare(f"train step gemm=native ({fmt})", "emulated", (step_of("emulated"), args),
                 (step_of("native"), args), repeats=repeats, iters=iters)


def run(*, small: bool, sizes: list[str] | None, repeats: int, iters: int, model: str,
        batch: int, seq_len: int, recipe: str, step_format: str,
        train_step: bool) -> tuple[str, list[Comparison]]:
  """(the printed report, the comparisons) of the flags' values (their help says each)."""
  if repeats < 1 or iters < 1:
    raise ValueError(f"--repeats={repeats} and --iters={iters} must be >= 1.")
  if small:
    sizes = sizes or list(SMALL_SIZES)
    model, batch, seq_len, iters = "tiny", 2, 16, min(iters, 2)
  shapes = [parse_size(s) for s in (sizes or GPU_SIZES)]
  device = jax.devices()[0]
  results = []
  for m, k, n in shapes:
    results += gemm_comparisons(m, k, n, repeats=repeats, iters=iters)
  if train_step:
    results.append(train_step_comparison(model, batch, seq_len, recipe, step_format,
                                         repeats=repeats, iters=iters))
  lines = [f"backend {jax.default_backend()} ({device.device_kind}), {repeats} rounds x {iters} "
           "calls; ratio = baseline time / candidate time per round: median [min, max]",
           HEADER] + [r.row() for r in results]
  if train_step:
    lines.append(f"train step: --model={model} batch {batch} x {seq_len} tokens, recipe {recipe} "
                 f"with format {step_format}")
  return "\n".join(lines), results


def write_json(results: list[Comparison], path: str) -> None:
  """The comparisons as a JSON list (each with its median `ratio`)."""
  with open(path, "w") as f:
    json.dump([dict(dataclasses.asdict(r), ratio=r.ratio) for r in results], f, indent=1)


def main(argv):
  del argv
  user_cache.enable_compile_cache()
  text, results = run(small=_SMALL.value, sizes=_SIZES.value, repeats=_REPEATS.value,
                      iters=_ITERS.value, model=_MODEL.value, batch=_BATCH.value,
                      seq_len=_SEQ_LEN.value, recipe=_RECIPE.value,
                      step_format=_STEP_FORMAT.value, train_step=_STEP.value)
  print(text)
  if _OUT.value:
    write_json(results, _OUT.value)


if __name__ == "__main__":
  # Flags only when run as a binary: the tests import several experiments (one absl flag registry).
  _SMALL = flags.DEFINE_bool("small", False, "Tiny sizes and the tiny model (CPU tests).")
  _SIZES = flags.DEFINE_list("sizes", None, f"GEMM sizes MxKxN; default {GPU_SIZES} "
                             f"(--small: {SMALL_SIZES}).")
  _REPEATS = flags.DEFINE_integer("repeats", 5, "Timed rounds per comparison.")
  _ITERS = flags.DEFINE_integer("iters", 10, "Calls per timed round (--small: 2).")
  _MODEL = flags.DEFINE_string("model", "qwen3_0_6b", "Model preset of the train step (--small: "
                               "tiny).")
  _BATCH = flags.DEFINE_integer("batch", 8, "Sequences per train step (--small: 2).")
  _SEQ_LEN = flags.DEFINE_integer("seq_len", 1024, "Tokens per sequence (--small: 16).")
  _RECIPE = flags.DEFINE_enum("recipe", "mxfp8", precision.RECIPES, "Precision recipe of the step.")
  _STEP_FORMAT = flags.DEFINE_enum("step_format", "fp8_e4m3",
                                   ["fp8_e4m3", "fp8_e5m2", "mxfp8_e4m3", "mxfp8_e5m2"],
                                   "precision.format of the train step (an FP8 format).")
  _STEP = flags.DEFINE_bool("train_step", True, "Also time the train step.")
  user_cache.define_compile_cache_flag()
  _OUT = flags.DEFINE_string("out", "", "Optional JSON file for the results.")
  app.run(main)
