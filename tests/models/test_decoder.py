"""Execution knobs of the model at scale: scanned layers, remat, chunked attention, chunked
log-probabilities. Each is checked against the default (unrolled, materialized, full-vocabulary)
path: bit for bit where the same operations run, else within a bound derived below."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import tiny
from lowrl import precision
from lowrl.models import calibration, decoder, init, layout, logprobs, transformer
from lowrl import sampling
from lowrl.sampling import SamplingConfig

from model_scale_helpers import DEEP, SHALLOW, _batch, _loss_and_grads, _params, _policy, _same


# ----------------------------------------------------------------------------------------------
# Scanned layers.


def test_layer_groups_split_at_the_bf16_suffix():
  policy = _policy("nvfp4_recipe", tiny.DEEP)
  tail = precision.bf16_tail_layers(tiny.DEEP.n_layers, 0.15)
  assert tail == (7,)
  assert decoder.layer_groups(tiny.DEEP, policy) == ((0, 7), (7, 8))
  assert decoder.layer_groups(tiny.DEEP, _policy("fp32", tiny.DEEP)) == ((0, 8),)
  # A BF16 layer in the middle splits the quantized layers into two runs.
  mid = _policy("nvfp4_recipe", tiny.DEEP, bf16_last_fraction=0.0, high_precision_paths=r"layers_3/.*")
  assert decoder.layer_groups(tiny.DEEP, mid) == ((0, 3), (3, 4), (4, 8))


# 4 layers: layer 0 unquantized (a high-precision path), layers 1-2 quantized, layer 3 the BF16
# tail. One program covers both claims: a real scan of the quantized layers between two other
# groups (its input from a group before, its output into the BF16 tail's group), and stochastic
# rounding everywhere, so every layer's quant key must be fold_in(key, layer), also inside a
# scanned group that starts past layer 0.
SCAN_MODEL = dataclasses.replace(DEEP, n_layers=4)
# In each quantized layer two of the seven matmuls are NVFP4, one in attention and one in the MLP
# (the other five would only repeat the same keyed quantizers: all seven cost ~65% more CPU time
# per program).
TWO_NVFP4 = r"layers_\d+/(attn/(q|k|v)_proj|mlp/(gate|up)_proj)"


def test_scan_equals_unrolled_forward_and_gradients():
  policy = _policy("nvfp4_recipe", SCAN_MODEL, stochastic_rounding="all",
                   high_precision_paths=r"layers_0/.*|" + TWO_NVFP4)
  assert policy.needs_key
  assert [(r.layer, r.path) for r in precision.assignment_table(
      policy, layout.matmuls(SCAN_MODEL)) if r.fmt == "nvfp4"] == [
          (i, p) for i in (1, 2) for p in ("attn/o_proj", "mlp/down_proj")]
  assert precision.bf16_tail_layers(SCAN_MODEL.n_layers, 0.15) == (3,)  # the recipe's 15%
  # Layer 0 and the tail are unquantized; the 2 quantized layers are one real scan.
  assert decoder.layer_groups(SCAN_MODEL, policy) == ((0, 1), (1, 3), (3, 4))
  key = jax.random.key(7)
  (loss_a, aux_a), grads_a = _loss_and_grads(SCAN_MODEL, policy, key)
  (loss_b, aux_b), grads_b = _loss_and_grads(dataclasses.replace(SCAN_MODEL, scan_layers=True),
                                             policy, key)
  assert np.isfinite(loss_a)
  assert _same((loss_a, aux_a), (loss_b, aux_b))
  # The gradients come out of two different XLA programs (a scan body and straight-line code),
  # which may lay out a backward dot differently. The gradient of a matmul run in BF16 is an FP32
  # accumulation rounded once to BF16 (then stored in the FP32 leaf): FP32 values a few FP32 ulp
  # apart round to BF16 values at most 1 BF16 ulp apart (they straddle at most one rounding
  # midpoint). So leaves whose values are all BF16 numbers are held to 1 BF16 ulp, every other
  # leaf (FP32 arithmetic throughout) bit for bit.
  assert jax.tree.structure(grads_a) == jax.tree.structure(grads_b)
  for a, b in zip(jax.tree.leaves(grads_a), jax.tree.leaves(grads_b)):
    a32, b32 = np.asarray(a, np.float32), np.asarray(b, np.float32)
    a16, b16 = a32.astype(jnp.bfloat16), b32.astype(jnp.bfloat16)
    if np.array_equal(a16.astype(np.float32), a32) and np.array_equal(b16.astype(np.float32), b32):
      ulp = np.spacing(np.abs(a16)).astype(np.float32)
      assert np.all(np.abs(a32 - b32) <= ulp), float(np.abs(a32 - b32).max())
    else:
      assert _same(a, b)
  assert jax.tree.structure(grads_b) == jax.tree.structure(_params(SCAN_MODEL))


def test_scan_with_static_act_amax_and_calibration():
  # 2 layers, both quantized (no BF16 tail): one real scan, the fewest layers it takes; two NVFP4
  # matmuls per layer (attention and MLP), each with its own static amax per layer.
  policy = _policy("nvfp4_naive", SHALLOW, high_precision_paths=TWO_NVFP4)  # per-tensor scales
  assert decoder.layer_groups(SHALLOW, policy) == ((0, 2),)
  paths = policy.act_paths(layout.matmuls(SHALLOW), "tensor")
  assert set(paths) == {f"layers_{i}/{p}" for i in (0, 1)
                        for p in ("attn/o_proj", "mlp/down_proj")}
  tokens, mask = _batch(SHALLOW)
  params = _params(SHALLOW)
  scanned = dataclasses.replace(SHALLOW, scan_layers=True)
  calib = jax.jit(calibration.calibrate_act_amax, static_argnames=("model_cfg", "policy", "paths"))
  amax_a = calib(params, tokens, model_cfg=SHALLOW, policy=policy, paths=paths, mask_BT=mask)
  amax_b = calib(params, tokens, model_cfg=scanned, policy=policy, paths=paths, mask_BT=mask)
  assert set(amax_a) == set(paths) and _same(amax_a, amax_b)
  fwd = jax.jit(transformer.forward, static_argnames=("model_cfg", "policy"))
  a = fwd(params, tokens, model_cfg=SHALLOW, policy=policy, mask_BT=mask, act_amax=amax_a)
  b = fwd(params, tokens, model_cfg=scanned, policy=policy, mask_BT=mask, act_amax=amax_a)
  assert _same(a, b)
  # The static amaxes are used, not the data's: other amaxes give other logits (x3: a power of
  # two would only shift every scale's exponent, which NVFP4 can leave exactly invariant).
  tripled = {p: 3 * v for p, v in amax_a.items()}
  c = fwd(params, tokens, model_cfg=scanned, policy=policy, mask_BT=mask, act_amax=tripled)
  assert not np.array_equal(a, c)


@pytest.mark.parametrize("name,overrides,extra,groups", [
    # nvfp4_recipe: 2 scanned quantized layers (two NVFP4 matmuls each, TWO_NVFP4), then the BF16
    # tail's group; each group reads and writes its layers' slices of the one stacked cache.
    ("nvfp4_recipe", {"high_precision_paths": TWO_NVFP4}, {}, ((0, 2), (2, 3))),
    # Chunked attention over the stacked cache. Attention runs in the compute dtype (BF16 under
    # both recipes), so the BF16 recipe (one group of 3 layers) is all it needs.
    ("bf16", {}, {"attention": "chunked", "attention_chunk": 16}, ((0, 3),)),
])
def test_scan_kv_cache_decode_equals_unrolled(name, overrides, extra, groups):
  """Greedy decoding through the sampler's while_loop: the stacked cache of the scanned model
  gives the unrolled model's tokens and log-probabilities bit for bit (chunk 16 >= every call's
  T, so the chunked attention runs the same rows in one chunk)."""
  policy = _policy(name, **overrides)
  assert decoder.layer_groups(DEEP, policy) == groups
  prompts = jnp.asarray(np.random.default_rng(3).integers(0, DEEP.vocab_size, (3, 6), np.int32))
  pmask = jnp.ones((3, 6), bool).at[1, :2].set(False)
  config = SamplingConfig(max_new_tokens=5, temperature=0.0)
  run = lambda cfg: sampling.generate(_params(), prompts, pmask, jax.random.key(0),  # noqa: E731
                                      model_cfg=cfg, policy=policy, config=config)
  out_a, cache_a = run(DEEP)
  out_b, cache_b = run(dataclasses.replace(DEEP, scan_layers=True, **extra))
  assert _same(out_a.tokens, out_b.tokens)
  assert _same(out_a.logprobs, out_b.logprobs)
  assert isinstance(cache_a["layers"], tuple) and len(cache_a["layers"]) == DEEP.n_layers
  assert cache_b["layers"]["k"].shape == (DEEP.n_layers,) + cache_a["layers"][0]["k"].shape
  for i in range(DEEP.n_layers):
    assert _same(cache_a["layers"][i], {n: cache_b["layers"][n][i] for n in ("k", "v")})


def _count_dots(n_layers: int, scan: bool) -> int:
  cfg = dataclasses.replace(DEEP, n_layers=n_layers, scan_layers=scan)
  tokens, mask = _batch(cfg)
  grad = jax.grad(lambda p: jnp.sum(logprobs.token_logprobs(
      p, tokens, cfg, _policy("bf16", cfg), mask_BT=mask)))
  return jax.jit(grad).lower(init.param_shapes(cfg)).as_text().count("dot_general")


def test_scanned_program_does_not_grow_with_depth():
  assert _count_dots(2, True) == _count_dots(3, True)
  assert _count_dots(3, False) > _count_dots(2, False)
