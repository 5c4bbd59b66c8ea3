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


def test_replay_refuses_scanned_layers_and_dense_models(params):
  with pytest.raises(ValueError, match="scan_layers"):
    routing.record_routing(params, TOKENS, dataclasses.replace(MOE, scan_layers=True), _policy())
  dense = dataclasses.replace(MOE, n_experts=0, n_experts_per_tok=0, moe_d_ff=0,
                              norm_topk_prob=False, shared_expert_d_ff=0)
  with pytest.raises(ValueError, match="mixture-of-experts"):
    routing.record_routing(params, TOKENS, dense, _policy())


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
