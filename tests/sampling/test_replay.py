"""Routing replay (`lowrl.sampling.replay`): the sampler's routing record (MoE) and the trainer's
replayed scores: the record is the sampler's own routing, replaying it is the trainer's own forward
when sampler = trainer, and pi_old (`replay.score`) and the update's logprob function replay
alike."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tiny import MOE
from lowrl.models import init, layout
from lowrl.precision import policy_for
from lowrl.sampling import Sampler, SamplingConfig, replay
from lowrl.training.rl_update import TokenBatch, make_logprob_fn
from lowrl.training.step import RLBatch

CONFIG = SamplingConfig(max_new_tokens=6, temperature=0.8)


@pytest.fixture(scope="module")
def rollout():
  params = init.init_params(MOE, jax.random.key(0))
  policy = policy_for("fp32", layout.matmuls(MOE))
  prompts = jax.random.randint(jax.random.key(1), (4, 5), 1, MOE.vocab_size)
  out = Sampler(MOE, policy, CONFIG, record_routing=True)(
      params, prompts, jnp.ones((4, 5), jnp.float32), jax.random.key(2))
  return params, policy, out


def _batch(out, routing):
  return RLBatch(out.tokens, out.attention_mask, out.completion_mask, out.logprobs,
                 jnp.zeros(out.tokens.shape[:1]), routing=routing)


def test_record_is_the_samplers_routing_and_replay_reproduces_it(rollout):
  """sampler = trainer (FP32, same weights): no flips, and the replayed pi_old is the trainer's
  own within FP32 rounding (same operations, two programs: ~1e-6 of |logp|)."""
  params, policy, out = rollout
  assert set(out.routing) == {"layers_0", "layers_1"}
  assert out.routing["layers_0"].shape == out.tokens.shape + (MOE.n_experts_per_tok,)
  own_logq, own = replay.score(out, params, model_cfg=MOE, policy=policy, config=CONFIG,
                               replay=False)
  rep_logq, rep_own = replay.score(out, params, model_cfg=MOE, policy=policy, config=CONFIG,
                                   replay=True)
  assert float(replay.flip_metrics(out, own)["routing/flips"]) == 0.0
  assert float(replay.flip_metrics(out, rep_own)["routing/flips"]) == 0.0
  np.testing.assert_allclose(np.asarray(rep_logq), np.asarray(own_logq), rtol=0, atol=1e-5)
  np.testing.assert_allclose(np.asarray(rep_logq), np.asarray(out.logprobs), rtol=0, atol=1e-4)


def test_pi_old_and_the_update_replay_the_same_routing(rollout):
  """Other experts than the sampler's: pi_old (`replay.score`) and the update's replaying
  logprob function give the same log q (the same forward: FP32 rounding apart), not the own
  routing's; without replay the logprob function ignores the batch's routing."""
  params, policy, out = rollout
  forced = {k: (v + 1) % MOE.n_experts for k, v in out.routing.items()}
  out_forced = out.replace(routing=forced)
  pi_old, own = replay.score(out_forced, params, model_cfg=MOE, policy=policy, config=CONFIG,
                             replay=True)
  # Layer 0's router sees the unreplayed input: every token's set differs from the forced one.
  assert float(replay._flips({"l": forced["layers_0"]}, {"l": own["layers_0"]},
                             out.completion_mask)) == 1.0
  assert float(replay.flip_metrics(out_forced, own)["routing/flips"]) > 0.5
  fn = jax.jit(make_logprob_fn(MOE, policy, CONFIG, replay=True))
  logq, _ = fn(params, _batch(out, forced), None)
  comp = np.asarray(out.completion_mask) > 0
  np.testing.assert_allclose(np.asarray(logq)[comp], np.asarray(pi_old)[comp], rtol=0, atol=1e-5)
  assert float(jnp.abs(pi_old - out.logprobs).max()) > 1e-2
  plain = jax.jit(make_logprob_fn(MOE, policy, CONFIG))
  np.testing.assert_array_equal(
      np.asarray(plain(params, _batch(out, forced), None)[0]),
      np.asarray(plain(params, TokenBatch(out.tokens, out.attention_mask), None)[0]))


def test_refusals(rollout):
  params, policy, out = rollout
  with pytest.raises(ValueError, match="sampler's routing"):
    replay.score(out.replace(routing=None), params, model_cfg=MOE, policy=policy, config=CONFIG,
                 replay=True)
  import dataclasses
  dense = dataclasses.replace(MOE, n_experts=0, n_experts_per_tok=0, moe_d_ff=0,
                              norm_topk_prob=False, shared_expert_d_ff=0)
  with pytest.raises(ValueError, match="mixture-of-experts"):
    Sampler(dense, policy_for("fp32", layout.matmuls(dense)), CONFIG, record_routing=True)


def test_packed_record_and_scores_match_the_padded_ones(rollout):
  """rl.pack_tokens: the routing record and `replay.score` (own routing and replayed) on packed
  rows (lowrl.models.packing: several sequences per row, segment-aware attention and positions)
  = the padded programs' per real token: expert ids equal, log q within 2e-5 (the FP32
  reassociation bound tests/training/test_packed_update.py states). Replaying forced experts
  moves log q by > 1e-2, so an id that did not travel with its token would show."""
  from lowrl.models.packing import PackConfig
  params, policy, out = rollout
  col, p = jnp.arange(out.tokens.shape[1]), out.prompt_width
  # Lengths 11, 4, 2, 7 (left padding, cut completions): rows of 14 hold [11 + 2], [4 + 7].
  pm = out.prompt_mask * (col >= jnp.asarray([0, 2, 3, 1])[:, None])
  cm = out.completion_mask * (col < p + jnp.asarray([6, 1, 0, 3])[:, None])
  out = out.replace(prompt_mask=pm, completion_mask=cm, logprobs=out.logprobs * cm)
  pack = PackConfig(14, rows=1)  # two micro-batches of one packed row
  real = np.asarray(out.attention_mask) > 0
  comp = np.asarray(cm) > 0

  def same_ids(a, b):
    for k in a:
      np.testing.assert_array_equal(np.asarray(a[k])[real], np.asarray(b[k])[real])

  recorded = [replay.record(out, params, model_cfg=MOE, policy=policy, pack=pk).routing
              for pk in (None, pack)]
  same_ids(*recorded)
  forced = out.replace(routing={k: (v + 1) % MOE.n_experts for k, v in recorded[0].items()})
  for o, on in ((out, False), (forced, True)):
    (logq, own), (logq_pk, own_pk) = (
        replay.score(o, params, model_cfg=MOE, policy=policy, config=CONFIG, replay=on, pack=pk)
        for pk in (None, pack))
    assert np.abs(np.asarray(logq)[comp]).max() > 0.5
    np.testing.assert_allclose(np.asarray(logq_pk)[comp], np.asarray(logq)[comp], rtol=0,
                               atol=2e-5)
    same_ids(own, own_pk)
  forced_logq = replay.score(forced, params, model_cfg=MOE, policy=policy, config=CONFIG,
                             replay=True)[0]
  assert float(jnp.abs(forced_logq - replay.score(out, params, model_cfg=MOE, policy=policy,
                                                  config=CONFIG, replay=False)[0]).max()) > 1e-2
