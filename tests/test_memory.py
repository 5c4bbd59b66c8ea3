"""lowrl.memory (per-device memory and FLOPs) and experiments/estimate_memory.

State bytes are checked against the arrays the code builds (jax.eval_shape of init_params,
init_opt_state, init_cache); the dominant activation terms against hand counts and against the
shapes of the FP32 arrays the model's forward actually creates; FLOPs against a hand count of
every matmul written out here.
"""
import dataclasses
import math

from absl import flags
from absl.testing import flagsaver
import jax
from jax.extend import core as jax_core
import jax.numpy as jnp
import numpy as np
import pytest

from configs import base as base_config
from experiments import estimate_memory
import tiny
from lowrl import hardware as hardware_lib
from lowrl import memory
from lowrl.models import init, layout, logprobs, transformer
from lowrl.models.config import preset
from lowrl.precision import PrecisionPolicy
from lowrl.training import optimizer as optimizer_lib

TINY = tiny.TINY  # V=64, D=32, L=2, H=4, K=2, hd=8, F=64, tied
# Untied head, qkv bias, qk norm: every optional leaf of the param tree.
TINY_FULL = preset("tiny", tie_embeddings=False, qkv_bias=True, qk_norm=True)


def _nbytes(tree) -> int:
  return sum(int(np.prod(x.shape)) * jnp.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree))


MODEL_KNOBS = ("remat", "attention", "attention_chunk", "logprob_chunk")


def _est(cfg=TINY, **kw):
  """The estimate of `cfg` with the model's execution knobs among `kw` set on it."""
  cfg = dataclasses.replace(cfg, **{k: kw.pop(k) for k in MODEL_KNOBS if k in kw})
  args = dict(batch=4, micro_batch=4, seq_len=16, max_new_tokens=4)
  args.update(kw)
  return memory.estimate(cfg, **args)


@pytest.mark.parametrize("cfg", [TINY, TINY_FULL])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_params_grads_reference_are_the_param_tree_bytes(cfg, dtype):
  params = jax.eval_shape(lambda k: init.init_params(cfg, k, jnp.dtype(dtype)),
                          jax.random.key(0))
  est = _est(cfg, param_dtype=dtype, reference_dtype=dtype, async_versions=2, async_dtype=dtype)
  assert est.params == _nbytes(params)
  assert est.grads == _nbytes(params)  # one micro-batch: no accumulator
  assert est.reference == _nbytes(params)
  assert est.async_versions == 2 * _nbytes(params)
  assert _est(cfg, micro_batch=2, param_dtype=dtype).grads == 2 * _nbytes(params)
  # PPO minibatches are optimizer steps of their own: no accumulator.
  assert _est(cfg, micro_batch=2, minibatches=2, param_dtype=dtype).grads == _nbytes(params)
  assert _est(cfg, keep_reference=False).reference == 0
  # FSDP over data x model: every device holds 1/8 (rounded up).
  assert _est(cfg, param_dtype=dtype, mesh=(4, 2)).params == math.ceil(_nbytes(params) / 8)


def test_optimizer_is_adams_two_fp32_moments():
  params = jax.eval_shape(lambda k: init.init_params(TINY_FULL, k), jax.random.key(0))
  tx = optimizer_lib.make_optimizer(base_config.get_config("bf16").optimizer, total_steps=10)
  state = jax.eval_shape(lambda p: optimizer_lib.init_opt_state(tx, p), params)
  leaves = jax.tree.leaves(state)
  moments = [x for x in leaves if jnp.issubdtype(x.dtype, jnp.floating)]
  counters = [x for x in leaves if not jnp.issubdtype(x.dtype, jnp.floating)]
  assert _est(TINY_FULL).optimizer == _nbytes(moments) == 2 * _nbytes(params)
  assert _nbytes(counters) <= 16  # the step counters the estimate leaves out


@pytest.mark.parametrize("kv_dtype", ["bfloat16", "float32"])
def test_kv_cache_is_init_cache_bytes(kv_dtype):
  rows, seq_len = 6, 20
  cache = jax.eval_shape(lambda: transformer.init_cache(TINY, rows, seq_len, jnp.dtype(kv_dtype)))
  est = _est(batch=rows, micro_batch=rows, seq_len=seq_len, kv_cache_dtype=kv_dtype)
  assert est.kv_cache == _nbytes(cache)
  # Sharded: rows over data; kv heads (K=2) over model when model divides them.
  kv = _nbytes(cache["layers"])
  mask = rows * seq_len
  on = lambda mesh: _est(batch=rows, micro_batch=rows, seq_len=seq_len,  # noqa: E731
                         kv_cache_dtype=kv_dtype, mesh=mesh).kv_cache
  assert on((2, 2)) == kv // 4 + mask // 2 + 4
  assert on((3, 4)) == kv // 3 + mask // 3 + 4  # 4 does not divide K=2: heads replicated


def _f32_array_shapes(fn, *args) -> set[tuple[int, ...]]:
  """Shapes of every FP32 array a jaxpr (and its sub-jaxprs) creates."""
  shapes = set()

  def walk(jaxpr):
    for eqn in jaxpr.eqns:
      for v in eqn.outvars:
        if hasattr(v.aval, "dtype") and v.aval.dtype == jnp.float32:
          shapes.add(tuple(v.aval.shape))
      for p in eqn.params.values():
        for sub in (p if isinstance(p, (tuple, list)) else (p,)):
          if isinstance(sub, jax_core.ClosedJaxpr):
            walk(sub.jaxpr)
          elif isinstance(sub, jax_core.Jaxpr):
            walk(sub)

  walk(jax.make_jaxpr(fn)(*args).jaxpr)
  return shapes


def test_dominant_activation_terms_by_hand():
  b, t = 2, 16  # micro-batch, tokens
  h, v, d, layers = 4, 64, 32, 2
  est = _est(batch=4, micro_batch=b, seq_len=t, compute_dtype="bfloat16")
  # FP32 probabilities + their BF16 copy, [B, H, T, T] per layer.
  assert est.act_scores == layers * b * h * t * t * (4 + 2)
  assert est.act_logits == 3 * b * t * v * 4
  assert est.act_head == b * t * d * (4 + 2)
  # Chunked logprobs: [B, T, chunk]; a chunk wider than V is the full vocabulary.
  assert _est(batch=4, micro_batch=b, seq_len=t, logprob_chunk=16).act_logits == 3 * b * t * 16 * 4
  assert _est(batch=4, micro_batch=b, seq_len=t, logprob_chunk=999).act_logits == est.act_logits
  # Chunked attention saves no scores: one chunk's [B, H, chunk, T] (FP32 + BF16) is live.
  chunked = _est(batch=4, micro_batch=b, seq_len=t, attention="chunked", attention_chunk=4)
  assert chunked.act_scores == b * h * 4 * t * 6
  assert _est(batch=4, micro_batch=b, seq_len=t, attention="chunked",
              attention_chunk=999).act_scores == b * h * t * t * 6  # one chunk = all rows
  # Remat: one layer's scores live at a time; the blocks keep only layer inputs + one layer.
  full = _est(batch=4, micro_batch=b, seq_len=t, remat="full")
  assert full.act_scores == b * h * t * t * 6
  per_token_layer = 2 * (4 * 32 + 3 * 32 + 3 * 16 + 3 * 64)  # bf16 x (4D + 3q + 3kv + 3F)
  assert est.act_layers == layers * b * t * per_token_layer
  assert full.act_layers == layers * b * t * 2 * d + b * t * per_token_layer
  # "dots" also keeps the projections' outputs: q, k, v, o_proj, gate, up, down.
  dots = _est(batch=4, micro_batch=b, seq_len=t, remat="dots")
  saved = 2 * (32 + 32 + 16 + 16 + 32 + 64 + 64 + 32)  # bf16 x (D input + outputs)
  assert dots.act_layers == layers * b * t * saved + b * t * per_token_layer
  assert dots.act_scores == full.act_scores
  # Batch over data, heads and vocabulary over model.
  split = _est(batch=4, micro_batch=b, seq_len=t, mesh=(2, 2))
  assert split.act_scores == est.act_scores // 4
  assert split.act_logits == est.act_logits // 4
  # The model's forward does build FP32 arrays of exactly these shapes.
  params = init.init_params(TINY, jax.random.key(0))
  tokens = jnp.zeros((b, t), jnp.int32)
  policy = PrecisionPolicy.unquantized(layout.matmuls(TINY), "bfloat16")
  shapes = _f32_array_shapes(
      lambda p, x: logprobs.token_logprobs(p, x, TINY, policy), params, tokens)
  assert (b, 2, 2, t, t) in shapes  # scores / probabilities [B, K, H / K, T, T]
  assert (b, t - 1, v) in shapes  # logits / log-softmax of the predicted positions
  # Chunked attention's forward builds [B, K, H / K, chunk, T] scores and no [.., T, T] ones.
  tiny_chunked = dataclasses.replace(TINY, attention="chunked", attention_chunk=4)
  shapes = _f32_array_shapes(
      lambda p, x: logprobs.token_logprobs(p, x, tiny_chunked, policy), params, tokens)
  assert (b, 2, 2, 4, t) in shapes and (b, 2, 2, t, t) not in shapes


def test_packed_micro_batch_sizes_the_update_activations_by_hand():
  """rl.pack_tokens: the update's activations are one packed micro-batch's (r rows of W
  columns, the scores W x W per row), the gradient counted twice (accumulated over the packed
  micro-batches); the KV cache, the sampler and the FLOPs stay the padded batch's."""
  h, v, d, layers, t = 4, 64, 32, 2, 16
  r, w = 3, 40
  padded = _est(batch=8, micro_batch=8, seq_len=t, compute_dtype="bfloat16")
  packed = _est(batch=8, micro_batch=8, seq_len=t, compute_dtype="bfloat16",
                packed_micro_batch=(r, w))
  per_token_layer = 2 * (4 * 32 + 3 * 32 + 3 * 16 + 3 * 64)  # bf16 x (4D + 3q + 3kv + 3F)
  assert packed.act_layers == layers * r * w * per_token_layer
  assert packed.act_scores == layers * r * h * w * w * (4 + 2)
  assert packed.act_logits == 3 * r * w * v * 4
  assert packed.act_head == r * w * d * (4 + 2)
  assert packed.grads == 2 * padded.grads
  for same in ("params", "optimizer", "kv_cache", "sampler_prefill", "flops"):
    assert getattr(packed, same) == getattr(padded, same), same
  # Packed rows split over the data devices like padded ones (r rows per device each).
  split = _est(batch=8, micro_batch=8, seq_len=t, compute_dtype="bfloat16", mesh=(2, 1),
               packed_micro_batch=(2 * r, w))
  assert split.act_layers == packed.act_layers
  with pytest.raises(ValueError, match="packed_micro_batch"):
    _est(packed_micro_batch=(0, w))


def test_flops_by_hand():
  # tiny: D=32, q=H*hd=32, kv=K*hd=16, F=64, V=64, L=2, tied head (reads the embedding).
  per_layer = 32 * 32 + 32 * 16 + 32 * 16 + 32 * 32 + 32 * 64 + 32 * 64 + 64 * 32
  blocks, head = 2 * per_layer, 32 * 64
  attn_pair = 4 * 2 * 32  # QK^T + AV, per query-key pair, all layers
  batch, seq_len, new = 4, 12, 4
  prompt = seq_len - new

  def forward(t):
    return 2 * (blocks + head) * t + attn_pair * t * t

  prefill = batch * (2 * blocks * prompt + 2 * head + attn_pair * prompt * prompt)
  decode = batch * sum(2 * (blocks + head) + attn_pair * (prompt + j) for j in range(1, new))
  est = _est(batch=batch, micro_batch=2, seq_len=seq_len, max_new_tokens=new, ppo_epochs=2,
             remat="full")
  f = est.flops
  assert f.sampler_prefill == prefill
  assert f.sampler_decode == decode
  assert f.trainer == 2 * batch * 3 * forward(seq_len)
  assert f.scoring == batch * forward(seq_len)
  assert f.reference == batch * forward(seq_len)
  assert f.remat_recompute == 2 * batch * (2 * blocks * seq_len + attn_pair * seq_len ** 2)
  assert f.total == prefill + decode + (6 + 1 + 1) * batch * forward(seq_len)
  assert _est(keep_reference=False).flops.reference == 0
  assert _est().flops.remat_recompute == 0
  # "dots" re-runs the attention einsums; chunked attention re-runs them once more.
  recompute = lambda **kw: _est(seq_len=seq_len, max_new_tokens=new, **kw  # noqa: E731
                                ).flops.remat_recompute
  assert recompute(remat="dots") == 4 * attn_pair * seq_len ** 2
  assert recompute(attention="chunked") == 4 * attn_pair * seq_len ** 2
  assert recompute(remat="full", attention="chunked") == 4 * (
      2 * blocks * seq_len + 2 * attn_pair * seq_len ** 2)


def test_step_time():
  hw = hardware_lib.Hardware("toy", bf16_tflops=1.0, fp8_tflops=2.0, fp4_tflops=None,
                             hbm_tbps=1e-3, hbm_gb=1.0)
  est = _est(mesh=(2, 1))
  t = memory.step_time(est, hw, mfu=0.5)
  rate = 2 * 1e12 * 0.5
  assert t.compute_s == pytest.approx(est.flops.total / rate, rel=1e-12)
  assert t.decode_hbm_s == pytest.approx(est.decode_hbm_bytes / 1e9, rel=1e-12)
  rest = (est.flops.total - est.flops.sampler_decode) / rate
  assert t.step_s == pytest.approx(
      rest + max(est.flops.sampler_decode / rate, t.decode_hbm_s), rel=1e-12)


def test_total_holds_the_state_once_and_the_larger_phase():
  params = jax.eval_shape(lambda k: init.init_params(TINY, k), jax.random.key(0))
  p = _nbytes(params)
  lean, full = _est(keep_reference=False), _est(async_versions=2)
  # The reference and two kept versions are FP32 copies of the tree, live through both phases.
  assert full.total - lean.total == 3 * p
  # The sampler's prefill and the update (grads + activations) never run at once: the peak holds
  # the state, the KV cache and one of the two phases, not both.
  state = [full.params, full.optimizer, full.reference, full.async_versions, full.kv_cache]
  update, sampler = full.grads + full.activations, full.sampler_prefill
  assert update > 0 and sampler > 0
  assert sum(state) + max(update, sampler) <= full.total < sum(state) + update + sampler
  assert full.params == p and full.optimizer == 2 * p  # Adam's two FP32 moments
  # The printed total is that number, and the report fits on one screen.
  text = memory.format_estimate(full, hardware_lib.HARDWARE["h100_sxm"])
  total_line = [line for line in text.splitlines() if line.split()[:1] == ["total"]]
  assert total_line and float(total_line[0].split()[1]) == round(full.total / memory.GB, 2)
  for word in ("params", "KV cache", "attention scores", "logits", "expected step"):
    assert word in text
  assert len(text.splitlines()) < 50


def test_check_fits_names_the_knobs():
  memory.check_fits(_est(), hbm_bytes=80e9)  # a tiny model fits
  big = memory.estimate(preset("qwen3_8b"), batch=64, micro_batch=8, seq_len=4096,
                        max_new_tokens=3584, mesh=(8, 1))
  with pytest.raises(ValueError) as e:
    memory.check_fits(big, hbm_bytes=80e9)
  for knob in ("micro_batch", "attention='chunked'", "remat='full'", "mesh"):
    assert knob in str(e.value)
  # State-bound: short sequences, no devices to spread over.
  state = memory.estimate(preset("qwen3_8b"), batch=8, micro_batch=8, seq_len=64,
                          max_new_tokens=32, mesh=(1, 1))
  with pytest.raises(ValueError) as e:
    memory.check_fits(state, hbm_bytes=80e9)
  for knob in ("param_dtype='bfloat16'", "reference_dtype='bfloat16'", "keep_reference=False",
               "mesh"):
    assert knob in str(e.value)


@pytest.mark.parametrize("kw, match", [
    (dict(micro_batch=3), "micro_batch=3 must divide batch=4"),
    (dict(remat="some"), "remat="),
    (dict(attention="fused"), "attention="),
    (dict(minibatches=3), "minibatches=3 must divide batch=4"),
    (dict(batch=8, minibatches=2, micro_batch=3), "micro_batch=3 must divide batch=8 / minibatches=2"),
    (dict(mesh=(0, 1)), "mesh"),
    (dict(param_dtype="float64"), "param_dtype="),
    (dict(seq_len=1000), "max_seq_len"),
    (dict(max_new_tokens=16), "max_new_tokens=16 must be < seq_len=16"),
    (dict(logprob_chunk=-1), "logprob_chunk"),
])
def test_bad_input_names_the_flag(kw, match):
  with pytest.raises(ValueError, match=match):
    _est(**kw)


def test_binary_qwen3_8b_on_8_h100(capsys):
  with flagsaver.flagsaver():
    flags.FLAGS(["estimate_memory", "--model=qwen3_8b", "--hardware=h100_sxm", "--devices=8"])
    assert estimate_memory.main([]) == 1  # today's defaults (no remat, FP32 scores) do not fit
    out = capsys.readouterr().out
    assert "qwen3_8b on 8 x h100_sxm" in out and "DOES NOT FIT" in out and "micro_batch" in out
    flags.FLAGS(["estimate_memory", "--remat=full", "--attention=chunked",
                 "--logprob_chunk=8192", "--reference_dtype=bfloat16"])
    assert estimate_memory.main([]) == 0
    assert "fits in 0.9 x 80 GB" in capsys.readouterr().out


def test_check_fits_takes_a_binarys_flag_names():
  big = memory.estimate(preset("qwen3_8b"), batch=8, micro_batch=8, seq_len=64,
                        max_new_tokens=32, mesh=(1, 1))
  hints = {k: f"--config.{k}" for k in memory.KNOB_HINTS}
  with pytest.raises(ValueError, match="--config.params") as e:
    memory.check_fits(big, 80e9, hints=hints)
  assert "shrink with --config.devices" in str(e.value)
  with pytest.raises(ValueError, match="hints lacks the keys"):
    memory.check_fits(big, 80e9, hints={"params": "x"})


def test_moe_params_flops_and_decode_reads_by_hand():
  """A mixture of experts: the state counts every expert (the param tree), the FLOPs the k
  experts a token reaches plus the router, the decode's weight reads every expert its rows reach."""
  moe = tiny.MOE  # D=32, E=4, k=2, expert F=32, shared F=16, untied head V=64
  shapes = init.param_shapes(moe)
  assert moe.num_params() == sum(x.size for x in jax.tree.leaves(shapes))
  d, L = moe.d_model, moe.n_layers
  attn = d * moe.q_dim + 2 * d * moe.kv_dim + moe.q_dim * d
  per_token = attn + d * 4 + 2 * 3 * d * 32 + 3 * d * 16 + d  # router, 2 experts, shared + gate
  assert memory.matmul_weights(moe) == L * per_token + d * moe.vocab_size
  est = memory.estimate(moe, batch=4, micro_batch=4, seq_len=16, max_new_tokens=8)
  # 4 rows x top-2 reach all 4 experts: each decode step reads all of them.
  every_expert = L * (attn + d * 4 + 4 * 3 * d * 32 + 3 * d * 16 + d) + d * moe.vocab_size
  kv = 2 * L * 4 * moe.n_kv_heads * moe.head_dim * 2 * sum(8 + j for j in range(1, 8))
  assert est.decode_hbm_bytes == 7 * every_expert * 2 + kv
  qwen = preset("qwen3_30b_a3b")
  assert round(qwen.num_params() / 1e9, 1) == 30.5  # Qwen3-30B-A3B: 30.5B total


def test_moe_param_counts_and_expert_parallel_state():
  """param_counts from the param tree itself (its expert leaves: [E, in, out] kernels), and the
  per-device state under expert parallelism: the experts over every device, the other weights
  over the devices outside the expert axis (lowrl.sharding.expert_parallel_rules)."""
  moe = tiny.MOE
  leaves = jax.tree_util.tree_leaves_with_path(init.param_shapes(moe))
  experts = sum(x.size for p, x in leaves if "experts" in jax.tree_util.keystr(p))
  total = sum(x.size for _, x in leaves)
  k, e = moe.n_experts_per_tok, moe.n_experts
  assert memory.param_counts(moe) == (total, experts, total - experts + experts * k // e)
  kw = dict(batch=8, micro_batch=8, seq_len=16, max_new_tokens=8, mesh=(8, 1),
            param_dtype="float32", keep_reference=False)
  fsdp = memory.estimate(moe, **kw)
  ep = memory.estimate(moe, expert_parallel=4, **kw)
  assert fsdp.params == -(-total * 4 // 8)
  assert ep.params == -(-experts * 4 // 8) + -(-(total - experts) * 4 // 2)
  assert ep.optimizer == 2 * ep.params and ep.act_layers == fsdp.act_layers
  assert (ep.n_params, ep.n_active) == (total, total - experts + experts * k // e)
  assert "active per token" in memory.format_estimate(ep)
  with pytest.raises(ValueError, match="expert_parallel=3"):
    memory.estimate(moe, expert_parallel=3, **kw)
  with pytest.raises(ValueError, match="mixture-of-experts"):
    memory.estimate(tiny.FULL, expert_parallel=2, **kw)


def test_parameter_counts_print_in_a_unit_that_shows_them():
  """The tiny model's 0.8 M parameters printed as "0.00 B" in billions."""
  assert [memory.format_count(n) for n in (7, 1000, 800_256, 1_234_567, 596_049_920,
                                           7_615_616_512, 30_532_122_624)] == [
      "7", "1.00 K", "800 K", "1.23 M", "596 M", "7.62 B", "30.5 B"]
  est = _est()
  line = next(l for l in memory.format_estimate(est).splitlines() if l.startswith("parameters:"))
  assert est.n_params < 5e6 and "0.00" not in line
  assert line == (f"parameters: {memory.format_count(est.n_params)}, "
                  f"{memory.format_count(est.n_active)} active per token")
