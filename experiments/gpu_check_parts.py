"""The measurements of experiments/gpu_check.py, one function per part (each runs in a process
of its own there; see that module for what each number means).

Every part builds its programs from the library's own code: `init.init_params`, the RL
step of the training loop (`training.step.make_step` with the loop's config schema defaults),
the `Sampler`, `lowrl.memory.estimate` and `lowrl.hardware`; timing is
`experiments.bench_gemm.compare` (baseline and candidate interleaved round by round).
"""
from __future__ import annotations

import dataclasses
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from configs import base as base_config
from experiments.bench_gemm import Comparison, compare
from lowrl import hardware as hardware_lib
from lowrl import memory, precision
from lowrl.models import config as model_config
from lowrl.models import init, layout
from lowrl.sampling import SampleOutput, SamplingConfig
from lowrl.sampling.rollout import Sampler
from lowrl.training import optimizer
from lowrl.training.rl_update import make_logprob_fn, update_config_from
from lowrl.training.step import BatchConfig, Rollout, make_step

# The precision settings compared with BF16: name -> (recipe, overrides of its knobs).
TRAIN_CANDIDATES = {
    "nvfp4_recipe": ("nvfp4_recipe", {}),
    "fp8_native": ("mxfp8", {"format": "fp8_e4m3", "gemm": "native"}),
}
ROLLOUT_CANDIDATES = {"nvfp4_recipe": ("nvfp4_recipe", {})}
BASELINE = ("bf16", {})
# The custom-call target XLA's GPU GEMM rewriter gives an FP8 GEMM (cuBLASLt):
# kCublasLtMatmulF8CallTarget in xla/service/gpu/cublas_cudnn.cc. The other counts say where
# the FP8 dots went when it is absent.
HLO_COUNTS = {"fp8_gemm_calls": "__cublas$lt$matmul$f8", "cublaslt_calls": "__cublas$lt$matmul",
              "cublas_gemm_calls": "__cublas$gemm", "f8e4m3fn_mentions": "f8e4m3fn"}
# lowrl.hardware's chip by a substring of the device_kind a backend reports.
DEVICE_KINDS = {"H200": "h200", "H100": "h100_sxm", "B200": "b200", "v5p": "v5p"}
ROLLOUT_MAX_REPEATS = 3  # a real-size rollout call takes seconds: fewer rounds, one call each


@dataclasses.dataclass(frozen=True)
class Shape:
  """One model and the step / rollout shapes it is measured at."""

  model: str            # a lowrl.models.config preset
  train_batch: int      # sequences per train step (a multiple of group_size)
  group_size: int
  prompt_len: int       # train step: prompt tokens per sequence
  new_tokens: int       # train step: completion tokens per sequence
  rollout_batch: int
  rollout_prompt_len: int
  rollout_new_tokens: int
  scan_layers: bool = True  # compile time independent of depth

  def model_cfg(self) -> model_config.ModelConfig:
    return model_config.preset(self.model, scan_layers=self.scan_layers)

  @property
  def seq_len(self) -> int:
    return self.prompt_len + self.new_tokens


def _real(model: str) -> Shape:
  return Shape(model=model, train_batch=8, group_size=8, prompt_len=512, new_tokens=512,
               rollout_batch=64, rollout_prompt_len=128, rollout_new_tokens=512)


SHAPES = {
    # The CPU test's: 2 layers unrolled (a quarter less compile than scanned, on CPU).
    "tiny": Shape(model="tiny", train_batch=4, group_size=2, prompt_len=6, new_tokens=6,
                  rollout_batch=2, rollout_prompt_len=4, rollout_new_tokens=4, scan_layers=False),
    "qwen3_0_6b": _real("qwen3_0_6b"),
    "qwen3_1_7b": _real("qwen3_1_7b"),
}


def device_info() -> dict[str, Any]:
  d = jax.devices()[0]
  hw = next((v for k, v in DEVICE_KINDS.items() if k in d.device_kind), None)
  return {"platform": d.platform, "device_kind": d.device_kind, "hardware": hw}


def _policy(cfg, setting):
  recipe, overrides = setting
  return precision.policy_for(recipe, layout.matmuls(cfg), **overrides)


def _estimate(shape: Shape) -> memory.MemoryEstimate:
  """The estimator's figures of the part's train step (FP32 master weights, BF16 compute, no
  reference, no KV cache in the step's process)."""
  return memory.estimate(shape.model_cfg(), batch=shape.train_batch,
                         micro_batch=shape.train_batch, seq_len=shape.seq_len,
                         max_new_tokens=shape.new_tokens, keep_reference=False)


def train_step_bytes(est: memory.MemoryEstimate) -> int:
  """What the estimator says one train step holds: params, Adam, grads, activations."""
  return est.params + est.optimizer + est.grads + est.activations


def _train_setup(shape: Shape, seed: int = 0):
  """(cfg, params, opt_state, rollout, step_of(setting) -> unjitted step) of the loop's RL step
  on a synthetic rollout: random tokens, the completion all real, rewards 0/1."""
  cfg = shape.model_cfg()
  rl = base_config.get_config("bf16").rl
  rl.group_size = shape.group_size
  rl.num_prompts = shape.train_batch // shape.group_size
  rl.max_new_tokens = shape.new_tokens
  tx = optimizer.make_optimizer(base_config.get_config("bf16").optimizer, total_steps=1)
  update_cfg = update_config_from(rl, "nearest", max_len=shape.new_tokens)
  batch_cfg = BatchConfig.from_rl(rl, shape.new_tokens)
  sampling = SamplingConfig(max_new_tokens=shape.new_tokens, temperature=rl.temperature)
  k_params, k_tok, k_rew = jax.random.split(jax.random.key(seed), 3)
  params = init.init_params(cfg, k_params)
  opt_state = jax.jit(lambda p: optimizer.init_opt_state(tx, p))(params)
  b, p, t = shape.train_batch, shape.prompt_len, shape.seq_len
  tokens = jax.random.randint(k_tok, (b, t), 1, cfg.vocab_size, jnp.int32)
  completion = np.broadcast_to(np.arange(t) >= p, (b, t)).astype(np.float32)
  # A plausible record: log(1/V) per completion token, the current and the stale score equal.
  logp = jnp.asarray(completion * np.float32(-np.log(cfg.vocab_size)))
  out = SampleOutput(tokens=tokens, prompt_mask=jnp.asarray(1 - completion),
                     completion_mask=jnp.asarray(completion), logprobs=logp, model_logprobs=logp,
                     prompt_lengths=jnp.full((b,), p, jnp.int32),
                     completion_lengths=jnp.full((b,), shape.new_tokens, jnp.int32),
                     prompt_width=p)
  rewards = jax.random.bernoulli(k_rew, 0.5, (b,)).astype(jnp.float32)
  rollout = Rollout(out, rewards, logp, logp)

  def step_of(setting):
    return make_step(make_logprob_fn(cfg, _policy(cfg, setting), sampling), tx, update_cfg,
                     batch_cfg)

  return cfg, params, opt_state, rollout, step_of


def _compiled(fn, args, donate=()):
  t0 = time.perf_counter()
  compiled = jax.jit(fn, donate_argnums=donate).lower(*args).compile()
  return compiled, time.perf_counter() - t0


def _comparison_json(c: Comparison) -> dict[str, Any]:
  return {"baseline_s": c.baseline_s, "candidate_s": c.candidate_s, "ratio": c.ratio,
          "ratio_min": min(c.ratios), "ratio_max": max(c.ratios), "ratios": list(c.ratios)}


def part_init(shape: Shape, emit, **_) -> dict[str, Any]:
  """Wall seconds of init_params (compile + run, then a cached call) at the real size."""
  cfg = shape.model_cfg()
  out = {}
  for call in ("first_call_s", "second_call_s"):
    t0 = time.perf_counter()
    jax.block_until_ready(init.init_params(cfg, jax.random.key(0)))
    out[call] = time.perf_counter() - t0
  out["num_params"] = cfg.num_params()
  return out


def part_train(shape: Shape, emit, *, repeats: int, iters: int) -> dict[str, Any]:
  """Each candidate's step against the BF16 step (interleaved), its MFU, and the native FP8
  step's compiled HLO searched for cuBLASLt FP8 GEMMs. `emit(result so far)` after each."""
  cfg, params, opt_state, rollout, step_of = _train_setup(shape)
  args = (params, opt_state, None, rollout, jax.random.key(1))
  flops = _estimate(shape).flops.trainer
  info = device_info()
  peak = (hardware_lib.hardware(info["hardware"]).flops_per_s("bf16") if info["hardware"]
          else None)
  mfu = lambda s: None if peak is None else flops / s / peak  # noqa: E731
  base, base_compile_s = _compiled(step_of(BASELINE), args)
  out = {"flops_per_step": flops, "bf16_peak_flops": peak,
         "bf16_compile_s": base_compile_s, "candidates": {}}
  emit(out)
  for name, setting in TRAIN_CANDIDATES.items():
    cand, compile_s = _compiled(step_of(setting), args)
    c = compare(f"train {name}", "bf16", (base, args), (cand, args), repeats=repeats,
                iters=iters)
    row = _comparison_json(c)
    row.update(compile_s=compile_s, mfu=mfu(c.candidate_s), baseline_mfu=mfu(c.baseline_s))
    if name == "fp8_native":
      text = cand.as_text()
      row.update({k: text.count(v) for k, v in HLO_COUNTS.items()})
      row["fp8_gemm_found"] = row["fp8_gemm_calls"] > 0 if info["platform"] == "gpu" else "n/a"
    out["candidates"][name] = row
    emit(out)
  return out


def part_rollout(shape: Shape, emit, *, repeats: int, iters: int) -> dict[str, Any]:
  """Prefill + decode of rollout_batch x rollout_new_tokens (no stop token: every row runs the
  whole budget) under each candidate against BF16: new tokens per second, over at most
  ROLLOUT_MAX_REPEATS rounds of one call each."""
  del iters
  cfg = shape.model_cfg()
  params = init.init_params(cfg, jax.random.key(0))
  b, p, n = shape.rollout_batch, shape.rollout_prompt_len, shape.rollout_new_tokens
  config = SamplingConfig(max_new_tokens=n, temperature=1.0)
  prompts = jax.random.randint(jax.random.key(1), (b, p), 1, cfg.vocab_size, jnp.int32)
  args = (params, prompts, jnp.ones((b, p), jnp.float32), jax.random.key(2))
  base = Sampler(cfg, _policy(cfg, BASELINE), config)
  tokens = b * n
  out = {"new_tokens_per_call": tokens, "candidates": {}}
  for name, setting in ROLLOUT_CANDIDATES.items():
    cand = Sampler(cfg, _policy(cfg, setting), config)
    t0 = time.perf_counter()
    jax.block_until_ready(cand(*args))
    compile_s = time.perf_counter() - t0
    c = compare(f"rollout {name}", "bf16", (base, args), (cand, args),
                repeats=min(repeats, ROLLOUT_MAX_REPEATS), iters=1)
    row = _comparison_json(c)
    row.update(tokens_per_s=tokens / c.candidate_s, baseline_tokens_per_s=tokens / c.baseline_s,
               first_call_s=compile_s)
    out["candidates"][name] = row
    emit(out)
  return out


def part_memory(shape: Shape, emit, **_) -> dict[str, Any]:
  """The BF16 step once, params and Adam state donated as the loop does, in a fresh process:
  the estimator's figure against the device's peak, and XLA's own memory analysis."""
  _, params, opt_state, rollout, step_of = _train_setup(shape)
  args = (params, opt_state, None, rollout, jax.random.key(1))
  compiled, _ = _compiled(step_of(BASELINE), args, donate=(0, 1))
  analysis = compiled.memory_analysis()
  xla_bytes = None if analysis is None else int(
      analysis.argument_size_in_bytes + analysis.output_size_in_bytes
      + analysis.temp_size_in_bytes - analysis.alias_size_in_bytes)
  jax.block_until_ready(compiled(*args))
  stats = jax.devices()[0].memory_stats()
  est = _estimate(shape)
  terms = {k: getattr(est, k) for k in ("params", "grads", "optimizer", "act_layers",
                                        "act_scores", "act_head", "act_logits")}
  peak = None if not stats else stats.get("peak_bytes_in_use")
  estimate_bytes = train_step_bytes(est)
  return {"estimate_bytes": estimate_bytes, "estimate_terms": terms, "peak_bytes": peak,
          "bytes_limit": None if not stats else stats.get("bytes_limit"),
          "xla_memory_analysis_bytes": xla_bytes,
          "peak_over_estimate": None if peak is None else peak / estimate_bytes}


PARTS = {"init": part_init, "train": part_train, "rollout": part_rollout, "memory": part_memory}
