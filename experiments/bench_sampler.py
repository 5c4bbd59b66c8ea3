r"""Sampler throughput per precision recipe, vs BF16 and vs tunix; packed-weight sizes.

  python -m experiments.bench_sampler                       # `small` model, all recipes
  python -m experiments.bench_sampler --model=tiny --batch=4 --prompt_len=16 --new_tokens=16

One process, one random-init model (FP32 master weights), the same pre-tokenized prompts for
every row. Each row is timed --repeats times after a compile run, *interleaved* (round r runs
every row once before round r + 1), so load from other processes hits all rows alike. Reported:
the median over rounds and the spread (min–max); ratios are taken per round (row / bf16 of the
same round) and then summarised the same way, which cancels most of the load drift.

lowrl rows (`generate`, no stop tokens, so every row decodes all N tokens):
  prefill  = `generate` with 1 new token: weight cast/quantization, the prompt pass into the KV
             cache, one sample;
  decode   = (`generate` with N tokens - prefill) / (N - 1) single-token while_loop steps;
  call     = `generate` with N tokens.
  Outputs: tokens, `logprobs` and `model_logprobs` (two FP32 [B, L] arrays), masks, lengths.
  Recipe rows reuse the donated KV cache (the `Sampler`'s mode); `bf16 fresh` allocates it each
  call, as tunix does.

tunix row (google-tunix 0.1.7 vanilla `Sampler` on a Qwen3 of the same sizes, FP32 params,
BF16 compute; Qwen3 adds q/k RMSNorm, which the lowrl `small` model has not): its jitted
prefill and decode programs are called directly on the same pre-tokenized ids, so no host
tokenization or detokenization is timed:
  prefill  = `init_sample_state` (fresh KV cache and buffers) + the prefill program (one sample);
  decode   = the decode while_loop / its N steps (tunix runs N steps after the prefill for N new
             tokens, the last one's token falling off the buffer: one more than lowrl);
  call     = prefill + decode.
  Outputs: the token buffer and one FP32 logprob buffer.

On CPU the quantized recipes are *emulated* (quantize, dequantize, BF16 GEMM): they measure the
cost of the emulation, not of FP4/FP8 kernels. The run ends with the packed size of every
quantized recipe's weights (`lowrl.sampling.pack_params`).
"""
import dataclasses
import os
import time
from typing import Callable

from absl import app, flags
import jax
import jax.numpy as jnp
import numpy as np

from lowrl import precision
from lowrl.models import config as model_config
from lowrl.models import calibration, init, layout
from lowrl import sampling, user_cache
from lowrl.quant import PackedWeight

_MODEL = flags.DEFINE_string("model", "small", f"Model preset: {model_config.preset_names()}.")
_BATCH = flags.DEFINE_integer("batch", 8, "Sequences per call.")
_PROMPT_LEN = flags.DEFINE_integer("prompt_len", 64, "Prompt tokens per sequence.")
_NEW_TOKENS = flags.DEFINE_integer("new_tokens", 64, "Generated tokens per sequence.")
_RECIPES = flags.DEFINE_list("recipes", list(precision.RECIPES), "Precision recipes to time.")
_REPEATS = flags.DEFINE_integer("repeats", 9, "Interleaved timed rounds (median and spread).")
_COMPILE_CACHE = user_cache.define_compile_cache_flag()
_TUNIX = flags.DEFINE_bool("tunix", True, "Also time tunix's vanilla sampler if importable.")

# One round of a row: {phase: seconds}, phases "prefill", "decode" (per step), "call".
Round = Callable[[], dict[str, float]]
PHASES = ("prefill", "decode", "call")


@dataclasses.dataclass
class Times:
  """Per-round seconds of every row, for one clock ("wall" or "cpu")."""
  rounds: dict[str, list[dict[str, float]]]

  def median(self, row: str, phase: str) -> float:
    return float(np.median([r[phase] for r in self.rounds[row]]))

  def spread(self, row: str, phase: str) -> tuple[float, float]:
    v = [r[phase] for r in self.rounds[row]]
    return min(v), max(v)

  def ratio(self, num: str, den: str, phase: str) -> tuple[float, float, float]:
    """(median, min, max) over rounds of time[den] / time[num]: > 1 means `num` is faster."""
    v = [d[phase] / n[phase] for n, d in zip(self.rounds[num], self.rounds[den])]
    return float(np.median(v)), min(v), max(v)


def _clock(fn):
  """(wall, process CPU) seconds of fn() and its result, blocked until ready."""
  wall, cpu = time.perf_counter(), time.process_time()
  out = jax.block_until_ready(fn())
  return time.perf_counter() - wall, time.process_time() - cpu, out


def lowrl_round(model_cfg, policy, params, prompts_BP, new_tokens, reuse_cache=True):
  """A `Round` of lowrl's `generate` (1 and N new tokens); compiles both programs first."""
  if new_tokens < 2:
    raise ValueError(f"--new_tokens={new_tokens}: decode needs at least 2 new tokens.")
  mask_BP = jnp.ones_like(prompts_BP)
  caches = {}
  # Per-tensor activation scales sample with static amaxes (here calibrated on the prompts).
  paths = policy.act_paths(layout.matmuls(model_cfg), "tensor")
  act_amax = calibration.calibrate_act_amax(params, prompts_BP, model_cfg, policy, paths) \
      if paths else None

  def call(n):
    config = sampling.SamplingConfig(max_new_tokens=n, temperature=1.0)
    out, cache = sampling.generate(params, prompts_BP, mask_BP, jax.random.key(1),
                                   model_cfg=model_cfg, policy=policy, config=config,
                                   cache=caches.get(n), act_amax=act_amax)
    if reuse_cache:
      caches[n] = cache
    return out

  def run(clock):
    t1, tn = clock(lambda: call(1)), clock(lambda: call(new_tokens))
    return [{"prefill": a, "decode": (b - a) / (new_tokens - 1), "call": b}
            for a, b in zip(t1[:2], tn[:2])]
  for n in (1, new_tokens):
    jax.block_until_ready(call(n))  # compile
  return run


class _IdTokenizer:
  """The tokenizer interface tunix's Sampler needs to build; only pad_id is used here."""

  def encode(self, text, **_):
    raise NotImplementedError("the benchmark feeds token ids")

  decode = encode

  def bos_id(self):
    return 1

  def eos_id(self):
    return 2

  def pad_id(self):
    return 0


def tunix_round(model_cfg, prompts_BP, new_tokens):
  """A `Round` of tunix's vanilla sampler on pre-tokenized ids, or None without tunix.

  Calls the Sampler's own steps (`init_sample_state`, its jitted prefill and decode) as
  `Sampler.__call__` does (tunix 0.1.7), minus tokenization and detokenization.
  """
  try:
    from flax import nnx  # noqa: PLC0415
    from tunix.generate import sampler as tunix_sampler  # noqa: PLC0415
    from tunix.models.qwen3 import model as tunix_qwen3  # noqa: PLC0415
  except ImportError as e:
    print(f"tunix: not importable ({e}); skipped. `pip install google-tunix==0.1.7` in a "
          "separate venv to compare.")
    return None
  batch, p = prompts_BP.shape
  cfg = tunix_qwen3.ModelConfig(
      num_layers=model_cfg.n_layers, vocab_size=model_cfg.vocab_size,
      embed_dim=model_cfg.d_model, hidden_dim=model_cfg.d_ff, num_heads=model_cfg.n_heads,
      head_dim=model_cfg.head_dim, num_kv_heads=model_cfg.n_kv_heads,
      rope_theta=int(model_cfg.rope_theta), norm_eps=model_cfg.rms_eps,
      use_tied_embedding=model_cfg.tie_embeddings, dtype=jnp.bfloat16, param_dtype=jnp.float32)
  sampler = tunix_sampler.Sampler(
      tunix_qwen3.Qwen3(cfg, rngs=nnx.Rngs(0)), _IdTokenizer(),
      tunix_sampler.CacheConfig(cache_size=p + new_tokens, num_layers=model_cfg.n_layers,
                                num_kv_heads=model_cfg.n_kv_heads, head_dim=model_cfg.head_dim))
  # Token 0 is tunix's pad (it masks pad ids): shift ids into [1, V). EOS = V, an id the model
  # cannot sample, so every row decodes all N tokens (lowrl runs without stop tokens).
  ids_BP = jnp.asarray(prompts_BP % (model_cfg.vocab_size - 1) + 1, jnp.int32)
  sampler.eos_ids = jnp.array([model_cfg.vocab_size])

  def prefill():
    state = sampler.init_sample_state(
        ids_BP, total_sampling_steps=p + new_tokens, include_logits=False,
        forbidden_token_ids=None, temperature=1.0, top_p=1.0, top_k=None,
        seed=jax.random.PRNGKey(0), beam_size=None, include_logprobs=True)
    return sampler._compiled_prefill_fn(sampler._flattened_transformer_state, state, None,
                                        echo=False)

  def decode(state):
    out = sampler._compiled_decode_fn(sampler._flattened_transformer_state, state)
    return out.token_buffer, out.logprobs_buffer

  def run(clock):
    pre = clock(prefill)
    dec = clock(lambda: decode(pre[2]))
    return [{"prefill": a, "decode": b / new_tokens, "call": a + b}
            for a, b in zip(pre[:2], dec[:2])]
  jax.block_until_ready(decode(prefill()))  # compile
  return run


def bench(rows: dict[str, Callable], repeats: int) -> dict[str, Times]:
  """Interleaved rounds of every row: {"wall": Times, "cpu": Times}."""
  times = {c: Times({name: [] for name in rows}) for c in ("wall", "cpu")}
  for _ in range(repeats):
    for name, run in rows.items():
      wall, cpu = run(_clock)  # one {phase: seconds} per clock
      times["wall"].rounds[name].append(wall)
      times["cpu"].rounds[name].append(cpu)
  return times


def _print_table(title, t: Times, batch, prompt_len, base="bf16"):
  print(f"\n{title}: median [min–max] over rounds; ratios per round vs {base}, > 1 = faster")
  print(f"{'row':<14} {'prefill tok/s':>22} {'vs ' + base:>20} {'decode tok/s':>22} "
        f"{'vs ' + base:>20} {'call ms':>20}")
  fmt_ratio = lambda r: f"{r[0]:.2f}x [{r[1]:.2f}–{r[2]:.2f}]"  # noqa: E731
  for name in t.rounds:
    cells = []
    for phase, tokens in (("prefill", batch * prompt_len), ("decode", batch)):
      lo, hi = t.spread(name, phase)
      med = tokens / t.median(name, phase)
      cells.append(f"{med:>7.0f} [{tokens / hi:.0f}–{tokens / lo:.0f}]")
      cells.append(fmt_ratio(t.ratio(name, base, phase)) if base in t.rounds else "-")
    lo, hi = t.spread(name, "call")
    call = f"{1e3 * t.median(name, 'call'):.1f} [{1e3 * lo:.1f}–{1e3 * hi:.1f}]"
    print(f"{name:<14} {cells[0]:>22} {cells[1]:>20} {cells[2]:>22} {cells[3]:>20} {call:>20}")


def packed_sizes(model_cfg, params, recipes) -> dict[str, dict[str, float]]:
  """Bytes per quantized parameter of each recipe's packed weights, split into its parts.

  Codes: 1/2 byte (E2M1, two per byte) or 1 (FP8); block scales: 1 byte per 16 (NVFP4) or 32
  (MX) elements; outer: the FP32 per-tensor scale (NVFP4), 4 bytes per quantized kernel, so
  4 / (mean elements per quantized kernel): it depends on the model's kernel sizes.
  """
  out = {}
  for name in recipes:
    packed = sampling.pack_params(params, model_cfg, precision.policy_for(name, layout.matmuls(model_cfg)))
    stats = sampling.packed_bytes(packed)
    if not stats["quantized_params"]:
      continue
    weights = [x for x in jax.tree.leaves(packed, is_leaf=lambda x: isinstance(
        x, PackedWeight)) if isinstance(x, PackedWeight)]
    n = stats["quantized_params"]
    part = lambda f: sum(int(f(w).nbytes) for w in weights if f(w) is not None) / n  # noqa: E731
    out[name] = {"bytes_per_quantized_param": stats["bytes_per_quantized_param"],
                 "codes": part(lambda w: w.codes), "block_scales": part(lambda w: w.scale),
                 "outer_scales": part(lambda w: w.outer), "kernels": len(weights),
                 "quantized_params": n, "bytes_per_param_all": stats["bytes_per_param"]}
  return out


def main(argv):
  del argv
  user_cache.enable_compile_cache()
  model_cfg = model_config.preset(_MODEL.value)
  batch, p, n = _BATCH.value, _PROMPT_LEN.value, _NEW_TOKENS.value
  print(f"model {_MODEL.value}: {model_cfg.num_params() / 1e6:.2f}M params, batch {batch}, "
        f"prompt {p}, new tokens {n}, backend {jax.default_backend()} "
        f"({jax.devices()[0].device_kind}), {_REPEATS.value} interleaved rounds, "
        f"load average at start {os.getloadavg()[0]:.1f}")
  params = init.init_params(model_cfg, jax.random.key(0))
  prompts_BP = jax.random.randint(jax.random.key(2), (batch, p), 0, model_cfg.vocab_size)
  rows = {name: lowrl_round(model_cfg, precision.policy_for(name, layout.matmuls(model_cfg)), params,
                            prompts_BP, n) for name in _RECIPES.value}
  if "bf16" in rows:
    rows["bf16 fresh"] = lowrl_round(model_cfg, precision.policy_for("bf16", layout.matmuls(model_cfg)), params,
                                     prompts_BP, n, reuse_cache=False)
  if _TUNIX.value and (tunix := tunix_round(model_cfg, prompts_BP, n)) is not None:
    rows["tunix"] = tunix
  times = bench(rows, _REPEATS.value)
  print(f"load average at end {os.getloadavg()[0]:.1f}")
  _print_table("wall clock", times["wall"], batch, p)
  _print_table("process CPU time", times["cpu"], batch, p)
  if "tunix" in rows and "bf16" in rows:
    for clock, t in times.items():
      for lowrl_row in ("bf16 fresh", "bf16"):
        r = {ph: t.ratio(lowrl_row, "tunix", ph) for ph in PHASES}
        print(f"{clock}: lowrl {lowrl_row} vs tunix (bf16), speed ratio per round, median "
              f"[min–max]: call {r['call'][0]:.2f}x [{r['call'][1]:.2f}–{r['call'][2]:.2f}], "
              f"prefill {r['prefill'][0]:.2f}x [{r['prefill'][1]:.2f}–{r['prefill'][2]:.2f}], "
              f"decode step {r['decode'][0]:.2f}x [{r['decode'][1]:.2f}–{r['decode'][2]:.2f}]")
  print("\npacked weights (pack_params), bytes per quantized parameter:")
  for name, s in packed_sizes(model_cfg, params, _RECIPES.value).items():
    print(f"{name:<14} {s['bytes_per_quantized_param']:.4f} = codes {s['codes']:.4f} + block "
          f"scales {s['block_scales']:.4f} + outer scales {s['outer_scales']:.6f} "
          f"({s['kernels']} kernels, {s['quantized_params']} params; whole tree "
          f"{s['bytes_per_param_all']:.3f} bytes/param)")


if __name__ == "__main__":
  app.run(main)
