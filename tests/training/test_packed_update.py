"""Packed update and scoring (`rl.pack_tokens`, lowrl.models.packing) against the padded path."""
import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import tiny
from lowrl.models import init, logprobs
from lowrl.models import packing
from lowrl.training import schema
from lowrl.training.batch import RLBatch
from lowrl.training.rl_update import make_logprob_fn, make_rl_update
from lowrl.training.setup import build

# Bound on the packed vs padded logprobs (FP32 forward, 1-2 layers, d_model <= 128): both
# programs compute the same real function on every real token (the same keys, positions and
# weights); they differ only in how XLA's CPU GEMMs and the softmax sums block the other rows and
# the masked columns (a masked score is exp(-1e30 - max) = 0 exactly, so it adds 0, but the
# number of terms changes the blocking). The error of an FP32 forward of this size against the
# exact function is well below 1e-5 absolute on a logprob of magnitude <= ~log V (the same budget
# tests/test_sharding.py and the shared-prefill tests use for FP32 reassociation); each side
# is within it, so their difference is within 2e-5.
ATOL = 2e-5


def _setup(**rl):
  cfg = tiny.loop_config("fp32")
  cfg.model.n_layers = 2
  cfg.rl.update(num_prompts=4, group_size=4, max_new_tokens=6, log_kl_ref=False, **rl)
  return build(cfg)


def _batch(setup, seed: int = 3) -> RLBatch:
  """16 made-up rollouts: left-padded prompts of varied lengths, completions of varied lengths
  (one empty), right padding."""
  rows, p = setup.batch_size, setup.task.max_prompt_len
  t = p + setup.sampling.max_new_tokens
  k1, k2, k3, k4 = jax.random.split(jax.random.key(seed), 4)
  tokens = jax.random.randint(k1, (rows, t), 3, setup.model_cfg.vocab_size)
  lengths = jax.random.randint(k2, (rows,), 1, t - p + 1).at[5].set(0)
  prompt_lens = jax.random.randint(k4, (rows,), 2, p + 1)
  col = jnp.arange(t)
  loss_mask = ((col >= p) & (col < p + lengths[:, None])).astype(jnp.float32)
  input_mask = ((col >= p - prompt_lens[:, None]) & (col < p + lengths[:, None])
                ).astype(jnp.float32)
  return RLBatch(tokens_BT=tokens, input_mask_BT=input_mask, loss_mask_BT=loss_mask,
                 logp_sampler_BT=-jax.random.uniform(k3, (rows, t)) * loss_mask,
                 adv_B=jnp.linspace(-1.0, 1.0, rows))


def test_plan_places_every_real_token_once_and_keeps_its_position():
  """The packing itself (exact integers): every real token lands in one packed slot of its own
  shard, with its padded position and a segment of its own sequence; rows never overflow."""
  mask = np.zeros((8, 10), np.float32)
  lens, starts = [10, 3, 0, 7, 2, 5, 9, 1], [0, 4, 0, 3, 8, 5, 1, 9]
  for r, (n, s) in enumerate(zip(lens, starts)):
    mask[r, s:s + n] = 1
  pk = jax.tree.map(np.asarray, packing.plan(jnp.asarray(mask), 10, shards=2))
  b = 4
  for s in range(2):
    seen = set()
    for slot in range(b * 10):
      src = pk.src_SN[s, slot]
      if src == b * 10:
        assert pk.segment_SN[s, slot] == 0
        continue
      row, col = divmod(int(src), 10)
      assert mask[s * b + row, col] == 1
      assert pk.segment_SN[s, slot] == row + 1
      assert pk.positions_SN[s, slot] == mask[s * b + row, :col].sum()
      assert pk.dest_SM[s, src] == slot
      seen.add(int(src))
    assert len(seen) == mask[s * b:(s + 1) * b].sum()
  # First fit, in row order: shard 0 = 10 | 3 + 7, shard 1 = 2 + 5 + 1 | 9: 2 rows each.
  np.testing.assert_array_equal(pk.src_SN[0, 10:20] // 10, [1] * 3 + [3] * 7)
  np.testing.assert_array_equal(pk.segment_SN[1, :10], [1] * 2 + [2] * 5 + [4] + [0] * 2)
  assert int(pk.rows_used) == 2
  assert int(packing.micro_batches(pk, 1)) == 2 and int(packing.micro_batches(pk, 4)) == 1


@functools.lru_cache(maxsize=None)
def _packed_setup():
  setup = _setup()
  params = jax.tree.map(np.asarray, init.init_params(setup.model_cfg, jax.random.key(0)))
  return setup, params


def test_packed_logprobs_match_the_padded_forward():
  """Per token, the packed forward's logprobs and entropies = the padded forward's (ATOL)."""
  setup, params = _packed_setup()
  batch = _batch(setup)
  fn = make_logprob_fn(setup.model_cfg, setup.trainer_policy)
  padded = jax.jit(lambda p, b: fn(p, b, None))(params, batch)
  width = batch.tokens_BT.shape[1]
  pk = packing.plan(batch.input_mask_BT, width, 1)
  assert int(pk.rows_used) < batch.tokens_BT.shape[0]  # the batch really packs

  @jax.jit
  def packed(p, b):
    return tuple(packing.packed_scores(lambda mb, i=i: fn(p, mb, None)[i], pk, b.tokens_BT,
                                       3, width) for i in (0, 1))
  for got, want in zip(packed(params, batch), padded):
    assert np.abs(np.asarray(want)).max() > 1.0  # real logprobs / entropies
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=0, atol=ATOL)


def test_segments_do_not_attend_across_sequences():
  """Bitwise: a sequence's logprobs in a packed row do not depend on its neighbour's tokens."""
  setup, params = _packed_setup()
  cfg, pol = setup.model_cfg, setup.trainer_policy
  seg = jnp.asarray([[1] * 5 + [2] * 6 + [0] * 3])
  tokens = jax.random.randint(jax.random.key(1), seg.shape, 3, cfg.vocab_size)
  other = tokens.at[0, :5].set(jax.random.randint(jax.random.key(2), (5,), 3, cfg.vocab_size))
  score = jax.jit(lambda t: logprobs.token_logprobs(params, t, cfg, pol, segment_ids_BT=seg))
  a, b = np.asarray(score(tokens)), np.asarray(score(other))
  np.testing.assert_array_equal(a[0, 5:], b[0, 5:])
  assert a[0, 5] == 0.0  # a segment's first token has no context, like a row's
  assert not np.array_equal(a[0, 1:5], b[0, 1:5])


@functools.lru_cache(maxsize=None)
def _update(aggregation: str, pack_tokens: int, minibatches: int = 1):
  setup = _setup(aggregation=aggregation, num_minibatches=minibatches)
  cfg = dataclasses.replace(setup.update_cfg, pack=packing.PackConfig(pack_tokens, rows=2)
                            if pack_tokens else None)
  return setup, jax.jit(make_rl_update(make_logprob_fn(setup.model_cfg, setup.trainer_policy),
                                       optax.sgd(1.0), cfg))


def _grad(aggregation, pack_tokens, params, batch, minibatches=1):
  return tiny.sgd_gradient(_update(aggregation, pack_tokens, minibatches)[1], params, params,
                           batch)


@pytest.mark.parametrize("aggregation", ["token_mean", "seq_mean_token_mean"])
def test_packed_update_matches_the_padded_update(aggregation):
  """Gradient (SGD lr 1: params - new = g) and every metric of the packed update = the padded
  one's. Both programs compute the same real function of the params (same tokens, keys,
  positions; the loss and its weights as `rl.micro_batches`'s); they differ only in FP32
  reassociation: per-token logprobs within ATOL (above), the backward's sums over other row
  blockings. The tolerance 1e-4 (1 + |g|) elementwise is not a proof: it is ~400x the measured
  gap (max 2.4e-7 with |g| <= 0.16) and ~1e-3 of the gradient's scale, which a wrong packing (a
  token in another segment, a lost token, a shifted position) changes by O(|g|)."""
  setup, _ = _update(aggregation, 0)
  params = jax.tree.map(np.asarray, init.init_params(setup.model_cfg, jax.random.key(0)))
  batch = _batch(setup)
  t = batch.tokens_BT.shape[1]
  g_pad, m_pad = _grad(aggregation, 0, params, batch)
  g_pack, m_pack = _grad(aggregation, t + 4, params, batch)  # 2 rows per micro-batch
  assert m_pack["pack/micro_batches"] >= 2  # really accumulated over micro-batches
  assert m_pack["pack/padding_frac"] < m_pad["pack/padding_frac"]
  assert max(np.abs(x).max() for x in g_pad) > 1e-3
  for gp, gq in zip(g_pad, g_pack):
    np.testing.assert_array_less(np.abs(gq - gp), 1e-4 * (1 + np.abs(gp)))
  for key, v in m_pad.items():
    if key.startswith("pack/"):
      continue
    assert m_pack[key] == pytest.approx(v, rel=1e-4, abs=1e-5), key


def test_packed_update_with_two_minibatches_matches_the_padded_update():
  """rl.num_minibatches=2: each minibatch (rows i, i + 2, ...) packed by its own plan, its
  gradient accumulated over its own micro-batches; two SGD steps (lr 1), so params - new =
  g(p) of minibatch 0 + g(p - g(p)) of minibatch 1. Same bound as above: both programs compute
  that function; the second gradient is taken at points that differ by the first's FP32 gap
  (~1e-7), which moves it by ~1e-7 x the loss's curvature, far inside the bound."""
  setup, _ = _update("token_mean", 0, 2)
  params = jax.tree.map(np.asarray, init.init_params(setup.model_cfg, jax.random.key(0)))
  batch = _batch(setup)
  t = batch.tokens_BT.shape[1]
  g_pad, m_pad = _grad("token_mean", 0, params, batch, 2)
  g_pack, m_pack = _grad("token_mean", t + 4, params, batch, 2)
  # 8 sequences per minibatch, at most 2 per packed row, 2 rows per micro-batch: >= 2 each.
  assert m_pack["pack/micro_batches"] >= 4
  assert m_pack["pack/padding_frac"] < m_pad["pack/padding_frac"]
  g_one, _ = _grad("token_mean", 0, params, batch)  # one minibatch: another gradient
  assert max(np.abs(a - b).max() for a, b in zip(g_one, g_pad)) > 1e-3
  for gp, gq in zip(g_pad, g_pack):
    np.testing.assert_array_less(np.abs(gq - gp), 1e-4 * (1 + np.abs(gp)))
  for key, v in m_pad.items():
    if not key.startswith("pack/"):
      assert m_pack[key] == pytest.approx(v, rel=1e-4, abs=1e-5), key


def test_pack_tokens_checks():
  cfg = tiny.loop_config("fp32")
  cfg.rl.update(num_prompts=4, group_size=4, pack_tokens=3)
  with pytest.raises(ValueError, match=r"--config.rl.pack_tokens=3 is smaller than the longest "
                                       r"sequence"):
    build(cfg)
  cfg.rl.update(pack_tokens=4096, micro_batches=2)
  with pytest.raises(ValueError, match="rl.pack_tokens makes its own micro-batches"):
    schema.TRAIN.validate(cfg)
  cfg.rl.update(micro_batches=1, num_minibatches=2)
  schema.TRAIN.validate(cfg)  # minibatches are packed one by one
  cfg.rl.update(pack_tokens=-1, num_minibatches=1)
  with pytest.raises(ValueError, match="pack_tokens"):
    schema.TRAIN.validate(cfg)


def test_memory_estimate_sizes_the_update_as_the_packed_micro_batch():
  """setup's memory estimate gets the packed micro-batch: rl.pack_rows rows per data shard of
  rl.pack_tokens columns (at most a minibatch's rows)."""
  from lowrl import memory
  setup = _setup(pack_tokens=40, pack_rows=1)
  shards = setup.plan.batch_shards
  rows = min(shards, 16)  # 16 sequences
  assert dict(setup.memory.settings)["packed_micro_batch"] == f"{rows} rows x 40"
  want = memory.estimate(setup.model_cfg, batch=16, micro_batch=16, mesh=(shards, 1),
                         seq_len=setup.task.max_prompt_len + 6, max_new_tokens=6,
                         packed_micro_batch=(rows, 40), compute_dtype="float32")
  assert setup.memory.act_layers == want.act_layers > 0
  big = _setup(pack_tokens=40, pack_rows=64, num_minibatches=2)
  assert dict(big.memory.settings)["packed_micro_batch"] == "8 rows x 40"  # a minibatch


def test_micro_batch_gathers_routing_ids_with_their_tokens():
  """MoE routing replay: a packed slot's recorded expert ids are its source token's (exact)."""
  mask = jnp.asarray(np.tri(8, 6, 2, dtype=np.float32)[::-1].copy())  # varied lengths
  tokens = jnp.arange(48, dtype=jnp.int32).reshape(8, 6)
  ids = {"layers_0": jnp.stack([tokens, tokens + 100], -1)}  # [B, T, k]
  pk = packing.plan(mask, 6, shards=2)
  for j in range(int(packing.micro_batches(pk, 1))):
    mb = packing.micro_batch(pk, tokens, jnp.asarray(j), 1, 6, ids)
    real = np.asarray(mb.segment_ids_BT) > 0
    got = np.asarray(mb.routing["layers_0"])
    np.testing.assert_array_equal(got[..., 0][real], np.asarray(mb.tokens_BT)[real])
    np.testing.assert_array_equal(got[..., 1][real], np.asarray(mb.tokens_BT)[real] + 100)


def _trainers(model=None, **rl):
  """A padded and a packed Trainer of one config (fp32; 8 fake devices, data parallel); the
  packed one's rows are 2 T wide, 1 row per shard in a micro-batch."""
  from lowrl.training.trainer import Trainer
  out = []
  for rows in (0, 1):
    cfg = tiny.loop_config("fp32")
    cfg.model.update(**(model or {}))
    cfg.rl.update(**{"num_prompts": 4, "group_size": 4, "max_new_tokens": 6, **rl})
    setup = build(cfg)
    if rows:
      cfg.rl.update(pack_tokens=2 * (setup.task.max_prompt_len + cfg.rl.max_new_tokens),
                    pack_rows=rows)
      setup = build(cfg)
    out.append(Trainer(setup, log=lambda _: None))
  return out


def _shortened(out, seed: int = 4):
  """`out` with completions cut to random lengths (0 to all): an untrained model rarely stops,
  and rows that all run to the horizon leave nothing to pack."""
  rows, width = out.tokens.shape
  keep = jax.random.randint(jax.random.key(seed), (rows, 1), 0, width - out.prompt_width + 1)
  cm = out.completion_mask * (jnp.arange(width) < out.prompt_width + keep)
  return out.replace(completion_mask=cm, logprobs=out.logprobs * cm,
                     model_logprobs=out.model_logprobs * cm,
                     completion_lengths=jnp.sum(cm, -1).astype(jnp.int32))


def test_trainer_scores_and_step_on_8_devices_match_the_padded_path():
  """On the 8-device data-parallel mesh: exact mode's record = the packed trainer's pi_old bit
  for bit (one program); the packed score (rescore) within ATOL of the padded one's; the packed
  step's metrics (the reference's KL included: scored packed) = the padded step's (the update
  test's bound)."""
  padded, packed = _trainers(num_prompts=8)
  assert packed.plan.batch_shards == 8
  setup = padded.setup
  sampler_params = init.init_params(setup.model_cfg, jax.random.key(0))
  params = init.init_params(setup.model_cfg, jax.random.key(5))
  roll, _ = packed.rollout(sampler_params, params, 0, jax.random.key(1), stale=True)
  # Exact mode: the sampler's record is the packed scoring program's, as is the trainer's score.
  k_quant = jax.random.split(jax.random.key(1))[1]
  again = packed.score(sampler_params, setup.trainer_policy, roll.out, k_quant)
  np.testing.assert_array_equal(np.asarray(again), np.asarray(roll.out.logprobs))
  out = _shortened(roll.out)
  mask = np.asarray(out.completion_mask) > 0
  assert 0 < mask.sum() < 0.8 * np.asarray(roll.out.completion_mask).sum()
  for p in (sampler_params, params):
    want, got = (np.asarray(tr.score(p, setup.trainer_policy, out, k_quant))
                 for tr in (padded, packed))
    assert np.abs(want[mask]).max() > 1.0
    np.testing.assert_allclose(got[mask], want[mask], rtol=0, atol=ATOL)
  rollout = roll._replace(out=out, logp_now_BT=roll.logp_now_BT * out.completion_mask,
                          logp_stale_BT=roll.logp_stale_BT * out.completion_mask)
  metrics = {}
  for name, tr in (("padded", padded), ("packed", packed)):
    p, ref = jax.tree.map(jnp.copy, params), jax.tree.map(jnp.copy, sampler_params)
    _, _, m = tr.step(p, tr.init_opt_state(p), ref, rollout, jax.random.key(2))
    metrics[name] = {k: float(v) for k, v in m.items()}
  # Rows hold several sequences (4 per shard, in fewer packed rows).
  assert metrics["packed"]["pack/micro_batches"] < 4
  assert metrics["padded"]["kl_ref"] > 1e-3  # a real reference score
  for key, v in metrics["padded"].items():
    if not key.startswith("pack/"):
      assert metrics["packed"][key] == pytest.approx(v, rel=1e-4, abs=1e-5), key


def test_moe_routing_replay_packed_rollout_and_step_match_the_padded_ones():
  """MoE with routing replay, rl.num_minibatches=2, 8 devices: the packed trainer's rollout (its
  routing record and replayed pi_old on packed rows) = the padded one's (ids equal per real
  token, pi_old within ATOL); in the step the recorded expert ids travel with their tokens into
  each minibatch's packed rows (a misplaced id would change the logprobs by O(1)); the step's
  metrics as above."""
  padded, packed = _trainers(dict(n_experts=4, n_experts_per_tok=2, moe_d_ff=32,
                                  norm_topk_prob=True), routing_replay=True, log_kl_ref=False,
                             num_minibatches=2)
  params = init.init_params(padded.setup.model_cfg, jax.random.key(0))
  rollouts = [tr.rollout(params, params, 0, jax.random.key(1), stale=False)[0]
              for tr in (padded, packed)]
  outs = [r.out for r in rollouts]
  np.testing.assert_array_equal(np.asarray(outs[0].tokens), np.asarray(outs[1].tokens))
  real = np.asarray(outs[0].attention_mask) > 0
  comp = np.asarray(outs[0].completion_mask) > 0
  for k in outs[0].routing:
    np.testing.assert_array_equal(np.asarray(outs[1].routing[k])[real],
                                  np.asarray(outs[0].routing[k])[real])
  np.testing.assert_allclose(np.asarray(rollouts[1].logp_now_BT)[comp],
                             np.asarray(rollouts[0].logp_now_BT)[comp], rtol=0, atol=ATOL)
  rollout = rollouts[0]._replace(out=_shortened(outs[0]))
  metrics = {}
  for name, tr in (("padded", padded), ("packed", packed)):
    p = jax.tree.map(jnp.copy, params)
    _, _, m = tr.step(p, tr.init_opt_state(p), None, rollout, jax.random.key(2))
    metrics[name] = {k: float(v) for k, v in m.items()}
  assert metrics["packed"]["pack/micro_batches"] >= 2  # one per minibatch at least
  for key, v in metrics["padded"].items():
    if not key.startswith("pack/"):
      assert metrics["packed"][key] == pytest.approx(v, rel=1e-4, abs=1e-5), key
