"""Mixture-of-experts block: grouped routing equals every-expert routing, routing replay (the
trainer reuses given experts while its router keeps its gradient), routing flips."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tiny import MOE
from lowrl.models import blocks, init, layout, moe, routing, transformer
from lowrl.precision import policy_for

_record = jax.jit(routing.record_routing, static_argnums=(2, 3))
_logprobs = jax.jit(routing.token_logprobs_replayed, static_argnums=(2, 3))
TOKENS = jax.random.randint(jax.random.key(1), (2, 8), 0, MOE.vocab_size)


@pytest.fixture(scope="module")
def params():
  return init.init_params(MOE, jax.random.key(0))


def _policy(name="fp32"):
  return policy_for(name, layout.matmuls(MOE))


def test_route_top_k_and_replay_weights():
  logits = jnp.array([[2.0, 0.5, 1.0, -1.0]])
  w, ids = moe.route(logits, 2, True)
  p = np.exp([2.0, 0.5, 1.0, -1.0])
  p /= p.sum()
  np.testing.assert_array_equal(np.asarray(ids), [[0, 2]])
  np.testing.assert_allclose(np.asarray(w), [[p[0] / (p[0] + p[2]), p[2] / (p[0] + p[2])]],
                             rtol=1e-6)
  w, ids = moe.route(logits, 2, False, replay_ids_Nk=jnp.array([[3, 1]]))
  np.testing.assert_array_equal(np.asarray(ids), [[3, 1]])
  np.testing.assert_allclose(np.asarray(w), [[p[3], p[1]]], rtol=1e-6)


def test_grouped_block_equals_every_expert_on_every_token(params):
  """The MoE MLP of layer 0 on its input against all E experts run densely on all tokens."""
  x = jax.random.normal(jax.random.key(2), (2, 8, MOE.d_model))
  p = params["layers_0"]["mlp"]
  module = moe.MoeMlp(MOE, 0, _policy(), dense=blocks.QDense)
  got = module.apply({"params": p}, x, None, None)
  e = p["experts"]
  h = jax.nn.silu(jnp.einsum("btd,edf->ebtf", x, e["gate_proj"]["kernel"]))
  h = h * jnp.einsum("btd,edf->ebtf", x, e["up_proj"]["kernel"])
  every_EBTD = jnp.einsum("ebtf,efd->ebtd", h, e["down_proj"]["kernel"])
  w, ids = moe.route(x @ p["router"]["kernel"], 2, True)
  want = jnp.einsum("btk,btkd->btd", w, jnp.take_along_axis(
      jnp.moveaxis(every_EBTD, 0, 2), ids[..., None], axis=2))
  s = p["shared_expert"]
  shared = (jax.nn.silu(x @ s["gate_proj"]["kernel"]) * (x @ s["up_proj"]["kernel"])) @ s[
      "down_proj"]["kernel"]
  want = want + jax.nn.sigmoid(x @ p["shared_expert_gate"]["kernel"]) * shared
  # FP32, same products, other summation orders: ~1e-6 relative to the output scale.
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=0,
                             atol=1e-5 * float(jnp.abs(want).max()))


def test_replaying_the_own_routing_changes_nothing(params):
  policy = _policy("nvfp4_moe_experts")
  logits, own = _record(params, TOKENS, MOE, policy)
  assert set(own) == {"layers_0", "layers_1"} and own["layers_0"].shape == (2, 8, 2)
  replayed, again = _record(params, TOKENS, MOE, policy, replay=own)
  np.testing.assert_array_equal(np.asarray(replayed), np.asarray(logits))
  assert float(routing.routing_flips(own, again)["mean"]) == 0.0
  np.testing.assert_array_equal(
      np.asarray(logits),
      np.asarray(jax.jit(transformer.forward, static_argnums=(2, 3))(params, TOKENS, MOE, policy)))


def test_gradients_reach_the_router_and_every_replayed_expert(params):
  """Replay sends every token to experts {0, 1}: those and the router get gradient, experts 2
  and 3 none; the logits are not the model's own routing's. (BF16: the quantized grouped
  GEMM's gradients are tests/quant/test_grouped_qdot.py's.)"""
  replay = {k: jnp.broadcast_to(jnp.array([1, 0], jnp.int32), (2, 8, 2))
            for k in ("layers_0", "layers_1")}
  policy = _policy("bf16")
  loss = lambda p, r: _logprobs(p, TOKENS, MOE, policy, r).sum()  # noqa: E731
  grads = jax.jit(jax.grad(loss))(params, replay)
  for layer in ("layers_0", "layers_1"):
    g = grads[layer]["mlp"]
    assert float(jnp.abs(g["router"]["kernel"]).sum()) > 0
    for proj in ("gate_proj", "up_proj", "down_proj"):
      per_expert = np.abs(np.asarray(g["experts"][proj]["kernel"])).sum(axis=(1, 2))
      assert (per_expert[:2] > 0).all() and (per_expert[2:] == 0).all(), (layer, proj)
  own = _logprobs(params, TOKENS, MOE, policy, None)
  forced = _logprobs(params, TOKENS, MOE, policy, replay)
  assert float(jnp.abs(own - forced).max()) > 1e-3


def test_routing_flips_counts_sets_not_orders():
  a = {"layers_0": jnp.array([[[0, 1], [2, 3], [1, 2]]])}
  b = {"layers_0": jnp.array([[[1, 0], [2, 3], [1, 3]]])}
  flips = routing.routing_flips(a, b)
  assert float(flips["layers_0"]) == pytest.approx(1 / 3)
  mask = jnp.array([[1, 1, 0]])
  assert float(routing.routing_flips(a, b, mask)["mean"]) == 0.0


def test_scanned_layers_record_and_replay_as_unrolled(params):
  """Under model.scan_layers the replayed ids enter the layer scan and the recorded ones leave it:
  the same routing, and logits within FP32 rounding of the unrolled forward's (same operations;
  XLA may fuse a scan body's differently: ~1e-6 relative)."""
  scanned = dataclasses.replace(MOE, scan_layers=True)
  policy = _policy()
  logits, own = _record(params, TOKENS, MOE, policy)
  s_logits, s_own = _record(params, TOKENS, scanned, policy)
  for k in own:
    np.testing.assert_array_equal(np.asarray(s_own[k]), np.asarray(own[k]))
  np.testing.assert_allclose(np.asarray(s_logits), np.asarray(logits), rtol=0,
                             atol=1e-5 * float(jnp.abs(logits).max()))
  forced = {k: jnp.broadcast_to(jnp.array([3, 1], jnp.int32), (2, 8, 2)) for k in own}
  fwd = jax.jit(routing.forward_routed, static_argnums=(2, 3))
  want, want_own = fwd(params, TOKENS, MOE, policy, forced)
  got, got_own = fwd(params, TOKENS, scanned, policy, forced)
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=0,
                             atol=1e-5 * float(jnp.abs(want).max()))
  for k in own:  # what the routers would have chosen in the replayed forward
    np.testing.assert_array_equal(np.asarray(got_own[k]), np.asarray(want_own[k]))
  assert float(routing.routing_flips(forced, got_own)["mean"]) > 0
  # Layer 0's router sees the same input whatever is replayed: its own choice is the model's.
  np.testing.assert_array_equal(np.asarray(got_own["layers_0"]), np.asarray(own["layers_0"]))


def test_replay_refuses_dense_models(params):
  dense = dataclasses.replace(MOE, n_experts=0, n_experts_per_tok=0, moe_d_ff=0,
                              norm_topk_prob=False, shared_expert_d_ff=0)
  with pytest.raises(ValueError, match="mixture-of-experts"):
    routing.record_routing(params, TOKENS, dense, _policy())
  with pytest.raises(ValueError, match="logprob_chunk=0"):
    routing.check_replay(dataclasses.replace(MOE, logprob_chunk=16))


def _replayed_block_reference(p, x_BTD, ids_BTk):
  """The replayed MoE MLP written from its definition (transformers' Qwen2MoeSparseMoeBlock with
  the top-k indices given): every expert on every token, the k given ones combined with their
  softmax probabilities renormalised, plus the sigmoid-gated shared expert. FP32 throughout."""
  probs_BTE = jax.nn.softmax(x_BTD @ p["router"]["kernel"], axis=-1)
  onehot_BTkE = jax.nn.one_hot(ids_BTk, probs_BTE.shape[-1])
  w_BTk = jnp.einsum("btke,bte->btk", onehot_BTkE, probs_BTE)
  w_BTk = w_BTk / w_BTk.sum(-1, keepdims=True)
  e = p["experts"]
  h = jax.nn.silu(jnp.einsum("btd,edf->btef", x_BTD, e["gate_proj"]["kernel"]))
  h = h * jnp.einsum("btd,edf->btef", x_BTD, e["up_proj"]["kernel"])
  y_BTED = jnp.einsum("btef,efd->bted", h, e["down_proj"]["kernel"])
  out = jnp.einsum("btk,btke,bted->btd", w_BTk, onehot_BTkE, y_BTED)
  s = p["shared_expert"]
  shared = (jax.nn.silu(x_BTD @ s["gate_proj"]["kernel"]) * (x_BTD @ s["up_proj"]["kernel"])) @ s[
      "down_proj"]["kernel"]
  return out + jax.nn.sigmoid(x_BTD @ p["shared_expert_gate"]["kernel"]) * shared


@pytest.mark.parametrize("jit", [True, False])
def test_replayed_block_gradients_equal_the_reference(params, jit):
  """d(sum of squares of the replayed block's output)/d(params) against autodiff of
  `_replayed_block_reference`: the router's gradient flows through the gathered probabilities
  (not zeroed ones), every replayed expert's kernels get theirs, unselected experts none. FP32,
  same products in other orders: the bound is ~1e-5 of each gradient's scale."""
  x = jax.random.normal(jax.random.key(3), (2, 8, MOE.d_model))
  ids = jax.random.randint(jax.random.key(4), (2, 8, 1), 0, 3)
  ids = jnp.concatenate([ids, (ids + 1) % 3], axis=-1)  # distinct pairs from experts {0, 1, 2}
  p = params["layers_0"]["mlp"]
  module = moe.MoeMlp(MOE, 0, _policy(), dense=blocks.QDense)
  ours = lambda q: jnp.sum(module.apply(  # noqa: E731
      {"params": q, moe.REPLAY: {moe.EXPERT_IDS: ids}}, x, None, None) ** 2)
  ref = lambda q: jnp.sum(_replayed_block_reference(q, x, ids) ** 2)  # noqa: E731
  grad = jax.jit(jax.grad(ours)) if jit else jax.grad(ours)
  got, want = grad(p), jax.grad(ref)(p)
  for path, g in jax.tree_util.tree_leaves_with_path(got):
    w = dict(jax.tree_util.tree_leaves_with_path(want))[path]
    np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=0,
                               atol=1e-5 * float(jnp.abs(w).max()) + 1e-30, err_msg=str(path))
  assert float(jnp.abs(got["router"]["kernel"]).sum()) > 0
  for proj in ("gate_proj", "up_proj", "down_proj"):
    per_expert = np.abs(np.asarray(got["experts"][proj]["kernel"])).sum(axis=(1, 2))
    assert (per_expert[:3] > 0).all() and per_expert[3] == 0, proj
  # Finite difference of the replayed block along the router's gradient (FP32, step 1e-2
  # relative: the second-order term dominates the error, a few percent).
  g = got["router"]["kernel"]
  eps = 1e-2 / float(jnp.linalg.norm(g))
  shifted = dict(p, router={"kernel": p["router"]["kernel"] + eps * g})
  fd = (float(ours(shifted)) - float(ours(p))) / eps
  assert fd == pytest.approx(float(jnp.sum(g * g)), rel=0.05)


def test_sampler_prequantized_experts_compute_what_the_trainer_does(params):
  """Rollout weights quantized ahead of time, one expert at a time (its own global scale):
  bit for bit the trainer's forward, which quantizes each expert inside the grouped matmul."""
  from lowrl.sampling import weights
  policy = _policy("nvfp4_moe_experts")
  fwd = jax.jit(transformer.forward, static_argnums=(2, 3))
  q_params, q_policy = weights.quantize_weights(params, MOE, policy)
  assert not q_policy.qdot_config("layers_0/mlp/experts/up_proj").rhs
  np.testing.assert_array_equal(np.asarray(fwd(q_params, TOKENS, MOE, q_policy)),
                                np.asarray(fwd(params, TOKENS, MOE, policy)))
  with pytest.raises(ValueError, match="stacked experts"):
    weights.pack_params(params, MOE, policy)
