"""The RL update: one pure function of (params, opt_state, ref_params, batch, key).

`batch` is a `lowrl.training.batch.RLBatch` (its docstring has the layout). The update takes
pi_old from `batch.logp_trainer_BT`, builds the sampler/trainer correction weights, then runs
`mu` passes of `num_minibatches` optimizer steps on the batch against that fixed pi_old. A
non-finite loss, gradient or updated state skips that optimizer step (params and optimizer state
unchanged) and is counted in the metrics.

pi_old is scored *outside* this function, by the same jitted scoring program the sampler uses
in exact mode (lowrl.sampling.rescore): two different XLA programs round BF16 activations
differently, and NVFP4 amplifies a one-ulp difference into a different code, so only the
identical program gives bit-identical logprobs (mismatch exactly 0 when sampler = trainer).
Only a batch without `logp_trainer_BT` (None) has pi_old recomputed here, inside the update's
own program.

Every logprob is of the distribution rollouts are sampled from, q = softmax(logits / temperature)
restricted to top-k / top-p (`make_logprob_fn`'s `sampling`): the importance weight of the
correction is q_trainer / q_sampler and the PPO ratio is q_theta / q_old, both on that one
distribution (verl scores logits / temperature the same way).

Decoupled PPO (Hilton et al. 2021, "Batch size-invariance for policy optimization"; AReaL):
behaviour policy pi_behav = the sampler, proximal policy pi_prox = pi_old. Per token the loss is
  -min(r A, clip(r, 1 - eps_low, 1 + eps_high) A) * sg(c),  r = pi_theta / pi_prox,
  c = correction(pi_prox / pi_behav) (rl.correction: 1 for none, truncated for TIS, masked for MIS).
old_logp_source=trainer: pi_prox = the trainer's score. old_logp_source=sampler: pi_prox =
pi_behav, so c is 1 by definition: rl.correction must be none (UpdateConfig rejects TIS/MIS, which
would divide by the sampler twice).
"""
from __future__ import annotations

import contextlib
import dataclasses
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import ml_collections
import optax

from lowrl.models import logprobs, packing, routing
from lowrl.models.config import ModelConfig
from lowrl.models.row_sharding import constrain_rows_tree
from lowrl.precision import PrecisionPolicy
from lowrl.rl.corrections import CorrectionConfig, correction_weights
from lowrl.rl.losses import LossConfig, aggregation_denominator, policy_loss
from lowrl.rl.masked import masked_count, masked_mean, safe_divide
from lowrl.rl.mismatch import OUTSIDE_SUPPORT_LOGP, in_support, mismatch_metrics
from lowrl.sampling import SamplingConfig, sampling_logits
from lowrl.sharding import ShardingPlan
from lowrl.training import compute_cast
from lowrl.training.batch import RLBatch
from lowrl.training.optimizer import apply_update, tree_all_finite

OLD_LOGP_SOURCES = ("trainer", "sampler")


class TokenBatch(NamedTuple):
  """What a `make_logprob_fn` function reads of a batch (an `RLBatch` has these fields too)."""

  tokens_BT: jax.Array
  input_mask_BT: jax.Array


@dataclasses.dataclass(frozen=True)
class UpdateConfig:
  """Static settings of the update (hashable)."""

  loss: LossConfig
  correction: CorrectionConfig
  mu: int = 1
  num_minibatches: int = 1
  old_logp_source: str = "trainer"
  master_rounding: str = "nearest"
  micro_batches: int = 1
  # optimizer.compute_cast_rounding=stochastic: the param keys whose FP32 -> BF16 compute cast is
  # rounded stochastically, fresh per update (lowrl.training.compute_cast); () = to nearest.
  compute_cast: tuple[tuple[str, ...], ...] = ()
  # rl.pack_tokens / rl.pack_rows: the forwards run on packed rows (lowrl.models.packing);
  # None = padded rows.
  pack: packing.PackConfig | None = None

  def __post_init__(self):
    if self.mu < 1:
      raise ValueError(f"rl.mu (inner updates per batch) must be >= 1, got {self.mu}.")
    if self.num_minibatches < 1:
      raise ValueError(f"rl.num_minibatches must be >= 1, got {self.num_minibatches}.")
    if self.micro_batches < 1:
      raise ValueError(f"rl.micro_batches must be >= 1, got {self.micro_batches}.")
    if self.pack is not None and self.micro_batches > 1:
      raise ValueError("rl.pack_tokens makes its own micro-batches (rl.pack_rows packed rows "
                       "per data shard); set rl.micro_batches=1, or rl.pack_tokens=0.")
    if self.old_logp_source not in OLD_LOGP_SOURCES:
      raise ValueError(f"rl.old_logp_source={self.old_logp_source!r}; use one of "
                       f"{OLD_LOGP_SOURCES}.")
    if self.old_logp_source == "sampler" and self.correction.mode != "none":
      # Decoupled PPO with pi_prox = pi_behav: the PPO ratio is already relative to the sampler,
      # so a TIS/MIS weight pi_trainer/pi_sampler on top would correct twice.
      raise ValueError(f"rl.correction={self.correction.mode!r} with rl.old_logp_source=sampler "
                       "corrects the sampler mismatch twice; set rl.correction=none or "
                       "rl.old_logp_source=trainer.")


def update_config_from(rl: ml_collections.ConfigDict, master_rounding: str,
                       max_len: int | None) -> UpdateConfig:
  """The update's static config from an `rl` section (lowrl.training.schema.RL validates it).

  `max_len` is the Dr.GRPO normaliser (the horizon; None = T). The loss, correction and update
  types raise ValueError for values outside their ranges.
  """
  loss = LossConfig(loss=rl.loss, clip_eps_low=rl.clip_eps_low, clip_eps_high=rl.clip_eps_high,
                    cispo_eps_max=rl.cispo_eps_max, aggregation=rl.aggregation or None,
                    max_len=max_len, kl_coef=rl.kl_coef, kl_estimator=rl.kl_estimator)
  correction = CorrectionConfig(mode=rl.correction, level=rl.correction_level, tis_cap=rl.tis_cap,
                                mis_low=rl.mis_low, mis_high=rl.mis_high)
  return UpdateConfig(loss=loss, correction=correction, mu=rl.mu,
                      num_minibatches=rl.num_minibatches, old_logp_source=rl.old_logp_source,
                      master_rounding=master_rounding, micro_batches=rl.micro_batches,
                      pack=pack_config_from(rl))


def pack_config_from(rl: ml_collections.ConfigDict) -> packing.PackConfig | None:
  """rl.pack_tokens / rl.pack_rows as a PackConfig (None: off, or a section without them)."""
  if not rl.get("pack_tokens", 0):
    return None
  return packing.PackConfig(row_tokens=rl.pack_tokens, rows=rl.pack_rows)


def make_logprob_fn(model_cfg: ModelConfig, policy: PrecisionPolicy,
                    sampling: SamplingConfig | None = None, *, replay: bool = False
                    ) -> Callable[[Any, TokenBatch | RLBatch, jax.Array | None], tuple[jax.Array, jax.Array]]:
  """(params, batch, quant_key) -> (logp_BT, entropy_BT) of the batch's tokens, FP32.

  `batch` needs only `tokens_BT` and `input_mask_BT` (a `TokenBatch` or an `RLBatch`).

  The distribution is the one rollouts are sampled from: `sampling`'s transform (logits /
  temperature, top-k, top-p; `lowrl.sampling.sampling_logits`) applied to the model's
  logits, the same transform the sampler's `logprobs` and `rescore(...).logprobs` use. None, or
  a config that leaves the distribution unchanged, = the raw model. A token outside the top-k /
  top-p support gets logp ~ -1e30 (probability exactly 0).

  `replay` (rl.routing_replay, MoE models): a batch's `routing` (the sampler's expert choices,
  `RLBatch.routing`) is replayed by the forward (lowrl.models.routing; the router keeps its
  gradient through the combine weights); a batch without one routes as the model does.
  """
  if sampling is not None and sampling.greedy:
    raise ValueError("The trained distribution needs rl.temperature > 0 (greedy has no logprobs).")
  if replay:
    routing.check_replay(model_cfg)
  transform = sampling is not None and sampling.modifies_distribution

  def logprob_fn(params, batch, quant_key):
    tokens_BT, mask_BT = batch.tokens_BT, batch.input_mask_BT
    # Packed rows (lowrl.models.packing.PackedTokens): segment ids in place of the mask.
    segment_ids_BT = getattr(batch, "segment_ids_BT", None)
    quant_key = policy.quant_key(quant_key)
    replay_ids = getattr(batch, "routing", None) if replay else None
    if replay_ids is None and not transform:
      return logprobs.token_logprobs_and_entropy(
          params, tokens_BT, model_cfg, policy, mask_BT=mask_BT, quant_key=quant_key,
          positions_BT=getattr(batch, "positions_BT", None), segment_ids_BT=segment_ids_BT)
    logits_BTV = routing.replayed_logits(params, tokens_BT, model_cfg, policy, replay_ids,
                                         mask_BT=mask_BT, quant_key=quant_key,
                                         segment_ids_BT=segment_ids_BT)
    if segment_ids_BT is not None:
      mask_BT = segment_ids_BT.astype(jnp.int32)  # predictions stay within a segment
    if not transform:
      return logprobs.logprobs_from_logits(logits_BTV, tokens_BT, mask_BT)
    q_logits_BTV = sampling_logits(logits_BTV, sampling)
    # OUTSIDE_SUPPORT_LOGP stands in for -inf: exp() of it is exactly 0 like -inf, but products
    # with 0 (entropy, CISPO's coef * logp) stay 0, not NaN.
    q_logits_BTV = jnp.maximum(q_logits_BTV, OUTSIDE_SUPPORT_LOGP)
    return logprobs.logprobs_from_logits(q_logits_BTV, tokens_BT, mask_BT)
  return logprob_fn


def _strided(tree, parts: int):
  """[n, ...] leaves as [n / parts, parts, ...]: part j = rows j, j + parts, j + 2 parts, ...

  Batches are split over the data shards in contiguous blocks, so when `parts` divides the rows
  per shard every part takes the same number of rows from every shard: selecting one is local
  to each device, on any mesh (contiguous parts would sit on a few shards and be resharded)."""
  return jax.tree.map(lambda x: x.reshape((x.shape[0] // parts, parts) + x.shape[1:]), tree)


def _part(tree, j):
  """Part `j` of a `_strided` tree, its rows pinned to their data shards (under `plan.rows`)."""
  return constrain_rows_tree(
      jax.tree.map(lambda x: jax.lax.dynamic_index_in_dim(x, j, axis=1, keepdims=False), tree))


def _minibatch_plans(cfg: UpdateConfig, mask_BT: jax.Array, pack, shards: int):
  """(plans stacked over the minibatches, rows, width, micro-batches [n]): each minibatch (its
  `_strided` part, b / n rows of every shard) packed on its own, its micro-batches by the same
  token budget. One minibatch: the batch's plan itself."""
  pk, rows, width, n_micro = pack
  n = cfg.num_minibatches
  if n == 1:
    return jax.tree.map(lambda x: x[None], pk), rows, width, n_micro[None]
  mb_rows = cfg.pack.layout(mask_BT.shape[0] // n, mask_BT.shape[1], shards)[1]
  plans = jax.vmap(lambda m: packing.plan(m, width, shards), in_axes=1)(_strided(mask_BT, n))
  return plans, mb_rows, width, jax.vmap(lambda p: packing.micro_batches(p, mb_rows))(plans)


# `policy_loss` metrics that are aggregated like the loss; the others are token means.
_AGGREGATED_METRICS = ("pg_loss",)


def make_rl_update(logprob_fn, tx: optax.GradientTransformation, cfg: UpdateConfig,
                   plan: ShardingPlan | None = None):
  """Builds `update(params, opt_state, ref_params, batch, key) -> (params, opt_state, metrics)`.

  `ref_params` None: no KL to a reference is computed (kl_coef must then be 0); given with
  kl_coef == 0, the KL to it is logged but not penalised. `plan`: the mesh the update is jitted
  on; its activations and minibatches then stay split over the batch axes (`plan.rows`).

  Minibatch i of `num_minibatches` = n is rows i, i + n, i + 2n, ... (strided, so that it
  draws evenly from every data shard); `micro_batches` = k splits each minibatch the same way
  and sums the k gradients, each micro-batch's loss weighted by its share of the aggregation's
  denominator (`aggregation_denominator`), so the accumulated loss and gradient are the
  minibatch's up to FP32 summation order. `pack` (rl.pack_tokens): pi_old and the reference
  are scored on the batch's packed rows; each minibatch is packed by a plan of its own and its
  gradient summed over its packed micro-batches, weighted the same way.
  """

  def update(params, opt_state, ref_params, batch: RLBatch, key: jax.Array):
    with plan.rows() if plan is not None else contextlib.nullcontext():
      return _update(params, opt_state, ref_params, batch, key)

  def _update(params, opt_state, ref_params, batch: RLBatch, key: jax.Array):
    key_fwd, key_opt = jax.random.split(key)
    mask_BT = batch.loss_mask_BT.astype(jnp.float32)
    batch_size = mask_BT.shape[0]
    if batch_size % cfg.num_minibatches:
      raise ValueError(f"batch of {batch_size} sequences is not divisible into "
                       f"rl.num_minibatches={cfg.num_minibatches}.")
    if (batch_size // cfg.num_minibatches) % cfg.micro_batches:
      raise ValueError(f"a minibatch of {batch_size // cfg.num_minibatches} sequences is not "
                       f"divisible into rl.micro_batches={cfg.micro_batches}.")

    def compute_weights(p, i):  # what update i's forward and backward run on
      if not cfg.compute_cast:
        return p
      return compute_cast.stochastic_cast(p, cfg.compute_cast, compute_cast.update_key(key, i))

    pack = mb_pack = None
    if cfg.pack is not None:  # packed rows: one plan for the batch (its scores)...
      shards = 1 if plan is None else plan.batch_shards
      width, rows = cfg.pack.layout(*batch.tokens_BT.shape, shards)
      pk = packing.plan(batch.input_mask_BT, width, shards)
      pack = (pk, rows, width, packing.micro_batches(pk, rows))
      mb_pack = _minibatch_plans(cfg, batch.input_mask_BT, pack, shards)

    def scores(p):  # pi_old / the reference: logp of the batch's tokens, padded layout
      if pack is None:
        return logprob_fn(p, batch, key_fwd)[0]
      return packing.packed_scores(lambda mb: logprob_fn(p, mb, key_fwd)[0], pack[0],
                                   batch.tokens_BT, pack[1], pack[2], batch.routing)

    if batch.logp_trainer_BT is not None:
      logp_trainer_BT = jax.lax.stop_gradient(batch.logp_trainer_BT)
    else:  # no external scorer: recompute inside this program (on update 0's weights)
      logp_trainer_BT = jax.lax.stop_gradient(scores(compute_weights(params, 0)))
    logp_sampler_BT = batch.logp_sampler_BT
    logp_old_BT = logp_trainer_BT if cfg.old_logp_source == "trainer" else logp_sampler_BT
    is_w_BT, corr_metrics = correction_weights(logp_trainer_BT, logp_sampler_BT, mask_BT,
                                               cfg.correction)
    # A token outside pi_old's top-k / top-p support (possible when the sampler's weights or
    # precision differ) has pi_old = 0: its PPO ratio is undefined and its corrected weight
    # pi_old / pi_sampler is 0, so it leaves the loss.
    in_support_BT = in_support(logp_old_BT).astype(jnp.float32)
    outside_support_frac = masked_mean(1.0 - in_support_BT, mask_BT)
    loss_mask_BT = mask_BT * in_support_BT
    use_is = cfg.correction.mode != "none"
    step_scale = corr_metrics["is_step_scale"] if cfg.correction.scales_step else None
    logp_ref_BT = None
    if ref_params is not None:  # penalised if kl_coef > 0, else only logged
      logp_ref_BT = jax.lax.stop_gradient(scores(ref_params))

    full = {"batch": batch._replace(loss_mask_BT=loss_mask_BT, logp_trainer_BT=None),
            "logp_old_BT": logp_old_BT, "is_w_BT": is_w_BT, "logp_ref_BT": logp_ref_BT}
    minibatches = _strided(full, cfg.num_minibatches)

    def loss_fn(p, b):
      mb_batch = b["batch"]
      logp_BT, entropy_BT = logprob_fn(p, mb_batch, key_fwd)
      loss, m = policy_loss(logp_BT, b["logp_old_BT"], mb_batch.adv_B, mb_batch.loss_mask_BT,
                            cfg.loss, logp_ref_BT=b["logp_ref_BT"],
                            is_weights_BT=b["is_w_BT"] if use_is else None)
      m["entropy"] = jax.lax.stop_gradient(masked_mean(entropy_BT, mb_batch.loss_mask_BT))
      return loss, m

    def packed_loss_and_grads(p, b, i):
      """`loss_and_grads` over minibatch `i`'s packed micro-batches (a loop of traced length):
      each one's loss is the padded layout's on the tokens it holds, weighted as
      `micro_batches` weights."""
      plans_k, rows, width, n_micro_k = mb_pack
      pk = jax.tree.map(lambda x: jax.lax.dynamic_index_in_dim(x, i, keepdims=False), plans_k)
      n_micro = n_micro_k[i]
      mb_batch, agg = b["batch"], cfg.loss.aggregation
      mask_BT = mb_batch.loss_mask_BT
      den_agg, den_tok = aggregation_denominator(mask_BT, agg), masked_count(mask_BT)

      def one(p, j):
        def loss_j(p):
          packed = packing.micro_batch(pk, mb_batch.tokens_BT, j, rows, width, mb_batch.routing)
          logp_RL, entropy_RL = logprob_fn(p, packed, key_fwd)
          logp_BT, in_j_BT = packing.unpack(pk, logp_RL, j, rows, mask_BT.shape)
          entropy_BT = packing.unpack(pk, entropy_RL, j, rows, mask_BT.shape)[0]
          mask_j_BT = mask_BT * in_j_BT
          loss, m = policy_loss(logp_BT, b["logp_old_BT"], mb_batch.adv_B, mask_j_BT, cfg.loss,
                                logp_ref_BT=b["logp_ref_BT"],
                                is_weights_BT=b["is_w_BT"] if use_is else None)
          m["entropy"] = jax.lax.stop_gradient(masked_mean(entropy_BT, mask_j_BT))
          return loss, (m, mask_j_BT)

        (loss, (m, mask_j_BT)), g = jax.value_and_grad(loss_j, has_aux=True)(p)
        w_agg = safe_divide(aggregation_denominator(mask_j_BT, agg), den_agg)
        w_tok = safe_divide(masked_count(mask_j_BT), den_tok)
        g = jax.tree.map(lambda x: w_agg * x.astype(jnp.float32), g)
        return g, {k: v * (w_agg if k in _AGGREGATED_METRICS + ("loss",) else w_tok)
                   for k, v in dict(m, loss=loss).items()}

      zeros = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype),
                           jax.eval_shape(one, p, jnp.zeros((), jnp.int32)))
      g_sum, m = jax.lax.fori_loop(
          0, n_micro, lambda j, acc: jax.tree.map(jnp.add, acc, one(p, j)), zeros)
      grads = jax.tree.map(lambda a, x: a.astype(x.dtype), g_sum, p)
      return (m.pop("loss"), m), grads

    def loss_and_grads(p, b, i):
      if pack is not None:
        return packed_loss_and_grads(p, b, i)
      if cfg.micro_batches == 1:
        return jax.value_and_grad(loss_fn, has_aux=True)(p, b)
      agg = cfg.loss.aggregation
      den_agg = aggregation_denominator(b["batch"].loss_mask_BT, agg)
      den_tok = masked_count(b["batch"].loss_mask_BT)
      micro = _strided(b, cfg.micro_batches)

      def one(g_acc, j):
        mb_j = _part(micro, j)
        (loss, m), g = jax.value_and_grad(loss_fn, has_aux=True)(p, mb_j)
        w_agg = safe_divide(aggregation_denominator(mb_j["batch"].loss_mask_BT, agg), den_agg)
        w_tok = safe_divide(masked_count(mb_j["batch"].loss_mask_BT), den_tok)
        # FP32 sums, whatever the params' dtype (BF16 master weights).
        g_acc = jax.tree.map(lambda a, x: a + w_agg * x.astype(jnp.float32), g_acc, g)
        parts = dict(m, loss=loss)
        return g_acc, {k: v * (w_agg if k in _AGGREGATED_METRICS + ("loss",) else w_tok)
                       for k, v in parts.items()}

      zeros = jax.tree.map(lambda x: jnp.zeros(x.shape, jnp.float32), p)
      g_sum, parts = jax.lax.scan(one, zeros, jnp.arange(cfg.micro_batches))
      grads = jax.tree.map(lambda a, x: a.astype(x.dtype), g_sum, p)
      m = {k: jnp.sum(v) for k, v in parts.items()}
      return (m.pop("loss"), m), grads

    def step(carry, i):
      p, o = carry
      b = _part(minibatches, i % cfg.num_minibatches)
      # The gradient at the compute copy is the master's (the cast passes it straight through).
      (loss, m), grads = loss_and_grads(compute_weights(p, i), b, i % cfg.num_minibatches)
      grad_norm = optax.tree.norm(grads)
      new_p, new_o = apply_update(tx, p, grads, o, master_rounding=cfg.master_rounding,
                                  key=jax.random.fold_in(key_opt, i), step_scale=step_scale)
      # Keep the old state when the loss, the gradient or the update is non-finite (a finite
      # gradient can still give a non-finite update, e.g. with a huge lr).
      ok = jnp.isfinite(loss) & tree_all_finite((grads, new_p, new_o))
      # One branch on the flag, not a select per leaf: XLA rewrites the finite check into a chain
      # of one `and` per leaf and fused a copy of that chain into every leaf's select, a program
      # quadratic in the leaf count (SmolLM2's 30 layers: > 12 min and > 6 GB of host memory to
      # compile this step; docs/real_model.md).
      p, o = jax.lax.cond(ok, lambda: (new_p, new_o), lambda: (p, o))
      m = dict(m, loss=loss, grad_norm=grad_norm, skipped=1.0 - ok.astype(jnp.float32))
      return (p, o), m

    (params, opt_state), step_metrics = jax.lax.scan(
        step, (params, opt_state), jnp.arange(cfg.mu * cfg.num_minibatches))

    metrics = {k: jnp.mean(v) for k, v in step_metrics.items() if k != "skipped"}
    metrics["skipped_updates"] = jnp.sum(step_metrics["skipped"])
    metrics["grad_norm_max"] = jnp.max(step_metrics["grad_norm"])
    metrics["entropy"] = step_metrics["entropy"][0]  # of pi_old, before any inner step
    metrics.update({f"mismatch/{k}": v for k, v in
                    mismatch_metrics(logp_sampler_BT, logp_trainer_BT, mask_BT).items()})
    metrics.update({f"correction/{k}": v for k, v in corr_metrics.items()})
    metrics["correction/outside_support_frac"] = outside_support_frac
    # Padding among the token slots the update's forwards compute in one pass over the batch.
    n_micro = None if pack is None else jnp.sum(mb_pack[3])  # over the minibatches
    slots = jnp.asarray(batch.tokens_BT.size) if pack is None else (
        n_micro * mb_pack[1] * mb_pack[2] * pack[0].src_SN.shape[0])
    metrics["pack/padding_frac"] = packing.padding_fraction(batch.input_mask_BT, slots)
    if pack is not None:
      metrics["pack/micro_batches"] = n_micro.astype(jnp.float32)
    return params, opt_state, metrics

  return update
