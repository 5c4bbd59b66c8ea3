r"""Sampler throughput: prefill and decode tokens/second per precision recipe, vs BF16.

  python -m experiments.bench_sampler                       # `small` model, all recipes
  python -m experiments.bench_sampler --model=tiny --batch=4 --prompt_len=16 --new_tokens=16

One process, one random-init model (FP32 master weights), the same prompts for every recipe.
Prefill = `generate` with one new token (the prompt pass into the KV cache, with the weights
quantized once); decode = the rest of `generate` with N tokens (N - 1 single-token steps of the
while_loop), no stop tokens, so every row decodes all N tokens; the KV cache is reused
(donated). Times are the minimum over --repeats runs after a compile run, interleaved across
recipes (the machine may be shared).

On CPU the quantized recipes are *emulated* (quantize, dequantize, BF16 GEMM): they measure the
cost of the emulation, not of FP4/FP8 kernels. When `tunix` (google-tunix) is importable, its
vanilla sampler runs a Qwen3-shaped model of the same size and batch for a side-by-side ratio.
"""
import time

from absl import app, flags
import jax
import jax.numpy as jnp

from lowrl import precision
from lowrl.models import config as model_config
from lowrl.models import transformer
from lowrl.sampling import sampler as sampling

_MODEL = flags.DEFINE_string("model", "small", f"Model preset: {model_config.preset_names()}.")
_BATCH = flags.DEFINE_integer("batch", 8, "Sequences per call.")
_PROMPT_LEN = flags.DEFINE_integer("prompt_len", 64, "Prompt tokens per sequence.")
_NEW_TOKENS = flags.DEFINE_integer("new_tokens", 64, "Generated tokens per sequence.")
_RECIPES = flags.DEFINE_list("recipes", list(precision.RECIPES), "Precision recipes to time.")
_REPEATS = flags.DEFINE_integer("repeats", 7, "Timed runs per measurement (minimum reported).")
_TUNIX = flags.DEFINE_bool("tunix", True, "Also time tunix's vanilla sampler if importable.")


def _seconds(fn) -> tuple[float, float]:
  """(wall-clock, process CPU) seconds of one call."""
  wall, cpu = time.perf_counter(), time.process_time()
  jax.block_until_ready(fn())
  return time.perf_counter() - wall, time.process_time() - cpu


def _generate_fn(model_cfg, policy, params, prompts_BP, new_tokens):
  """A no-argument callable running `generate` (reusing its donated KV cache)."""
  mask_BP = jnp.ones_like(prompts_BP)
  config = sampling.SamplingConfig(max_new_tokens=new_tokens, temperature=1.0)
  cache = [None]

  def run():
    out, cache[0] = sampling.generate(params, prompts_BP, mask_BP, jax.random.key(1),
                                      model_cfg=model_cfg, policy=policy, config=config,
                                      cache=cache[0])
    return out.tokens
  return run


def bench_recipes(names, model_cfg, params, prompts_BP, new_tokens, repeats, extra_fns=None):
  """{clock: {recipe: (prefill tokens/s, decode tokens/s, seconds per generate call)}}.

  `extra_fns` ({name: (1-new-token callable, N-new-token callable)}, e.g. tunix's sampler) are
  timed the same way, interleaved with the recipes, and reported as extra rows.

  Prefill is timed as `generate` with one new token (prompt pass, weight quantization, one
  sample); decode as the difference to `generate` with all N tokens, over B * (N - 1) tokens.
  Runs are interleaved across recipes so that load on a shared machine hits all of them alike;
  both wall-clock and process CPU time are kept (minimum over runs), CPU time being the steadier
  of the two when other processes compete for the cores.
  """
  batch, p = prompts_BP.shape
  fns = {}
  for name in names:
    policy = precision.policy_for(name, model_cfg)
    fns[name] = (_generate_fn(model_cfg, policy, params, prompts_BP, 1),
                 _generate_fn(model_cfg, policy, params, prompts_BP, new_tokens))
    for fn in fns[name]:
      jax.block_until_ready(fn())  # compile
  for name, pair in (extra_fns or {}).items():
    fns[name] = pair
    for fn in pair:
      jax.block_until_ready(fn())  # compile
  names = list(fns)
  best = {clock: {name: [float("inf")] * 2 for name in names} for clock in ("wall", "cpu")}
  for _ in range(repeats):
    for name in names:
      for i, fn in enumerate(fns[name]):
        wall, cpu = _seconds(fn)
        best["wall"][name][i] = min(best["wall"][name][i], wall)
        best["cpu"][name][i] = min(best["cpu"][name][i], cpu)
  return {clock: {name: (batch * p / t1, batch * (new_tokens - 1) / max(tn - t1, 1e-9), tn)
                  for name, (t1, tn) in times.items()}
          for clock, times in best.items()}


def _print_table(title, results):
  base = results.get("bf16")
  print(f"\n{title}")
  print(f"{'recipe':<14} {'prefill tok/s':>14} {'vs bf16':>8} {'decode tok/s':>13} "
        f"{'vs bf16':>8} {'generate s':>11}")
  for name, (pre, dec, total) in results.items():
    rp = f"{pre / base[0]:.2f}x" if base else "-"
    rd = f"{dec / base[1]:.2f}x" if base else "-"
    print(f"{name:<14} {pre:>14.0f} {rp:>8} {dec:>13.0f} {rd:>8} {total:>11.3f}")


class _IdTokenizer:
  """The minimal tokenizer interface tunix accepts: characters are token ids."""

  def __init__(self, vocab_size):
    self._v = vocab_size

  def encode(self, text, **_):
    return [3 + (ord(c) % (self._v - 3)) for c in text]

  def decode(self, ids, **_):
    return "".join(chr(ord("a") + i % 26) for i in ids)

  def bos_id(self):
    return 1

  def eos_id(self):
    return 2

  def pad_id(self):
    return 0


def tunix_fns(model_cfg, batch, prompt_len, new_tokens):
  """(1-new-token, N-new-token) callables of tunix's vanilla sampler, or None without tunix.

  Each call is the full `Sampler.__call__` (tokenize, cache init, prefill, decode while_loop,
  detokenize). For N new tokens tunix runs the prefill plus N single-token steps (its last step
  writes past the buffer), one more than lowrl's prefill + N - 1.
  """
  try:
    from flax import nnx  # noqa: PLC0415
    from tunix.generate import sampler as tunix_sampler  # noqa: PLC0415
    from tunix.models.qwen3 import model as tunix_qwen3  # noqa: PLC0415
  except ImportError as e:
    print(f"tunix: not importable ({e}); skipped. `pip install google-tunix` to compare.")
    return None
  cfg = tunix_qwen3.ModelConfig(
      num_layers=model_cfg.n_layers, vocab_size=model_cfg.vocab_size,
      embed_dim=model_cfg.d_model, hidden_dim=model_cfg.d_ff, num_heads=model_cfg.n_heads,
      head_dim=model_cfg.head_dim, num_kv_heads=model_cfg.n_kv_heads,
      rope_theta=int(model_cfg.rope_theta), norm_eps=model_cfg.rms_eps,
      use_tied_embedding=model_cfg.tie_embeddings, dtype=jnp.bfloat16)
  model = tunix_qwen3.Qwen3(cfg, rngs=nnx.Rngs(0))
  sampler = tunix_sampler.Sampler(
      model, _IdTokenizer(model_cfg.vocab_size),
      tunix_sampler.CacheConfig(cache_size=prompt_len + new_tokens, num_layers=model_cfg.n_layers,
                                num_kv_heads=model_cfg.n_kv_heads, head_dim=model_cfg.head_dim))
  # prompt_len - 1 characters + BOS = prompt_len tokens.
  prompts = ["".join(chr(97 + (i * 7 + j) % 26) for j in range(prompt_len - 1))
             for i in range(batch)]

  def fn(n):
    # EOS = vocab_size: an id the model cannot sample, so every row decodes all n tokens
    # (lowrl runs without stop tokens).
    return lambda: sampler(prompts, max_generation_steps=n, max_prompt_length=prompt_len,
                           temperature=1.0, top_p=1.0, eos_tokens=[model_cfg.vocab_size],
                           seed=0).tokens
  return fn(1), fn(new_tokens)


def main(argv):
  del argv
  model_cfg = model_config.preset(_MODEL.value)
  batch, p, n = _BATCH.value, _PROMPT_LEN.value, _NEW_TOKENS.value
  print(f"model {_MODEL.value}: {model_cfg.num_params() / 1e6:.2f}M params, batch {batch}, "
        f"prompt {p}, new tokens {n}, backend {jax.default_backend()} "
        f"({jax.devices()[0].device_kind})")
  params = transformer.init_params(model_cfg, jax.random.key(0))
  prompts_BP = jax.random.randint(jax.random.key(2), (batch, p), 0, model_cfg.vocab_size)
  extra = None
  if _TUNIX.value:
    tunix = tunix_fns(model_cfg, batch, p, n)
    extra = {"tunix": tunix} if tunix else None
  results = bench_recipes(_RECIPES.value, model_cfg, params, prompts_BP, n, _REPEATS.value,
                          extra_fns=extra)
  _print_table("wall clock (tokens per second)", results["wall"])
  _print_table("process CPU time (tokens per CPU-second)", results["cpu"])
  for clock, res in results.items():
    base, tx = res.get("bf16"), res.get("tunix")
    if base and tx:
      print(f"{clock}: tunix vanilla sampler (BF16) {tx[2]:.3f} s per call "
            f"({batch * n / tx[2]:.0f} new tok/s); lowrl bf16 {base[2]:.3f} s "
            f"({batch * n / base[2]:.0f} new tok/s): lowrl/tunix speed ratio "
            f"{tx[2] / base[2]:.2f}x (prefill {base[0] / tx[0]:.2f}x, "
            f"decode {base[1] / tx[1]:.2f}x)")


if __name__ == "__main__":
  app.run(main)
