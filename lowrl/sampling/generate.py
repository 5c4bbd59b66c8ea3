"""Generation: one jitted prefill + `lax.while_loop` decode over a donated KV cache.

Layout (the "Sampler contract" in ARCHITECTURE.md): prompts arrive padded either way
([B, P] tokens + mask); inside, each row is left-aligned so its last prompt token sits in
column P - 1, and the completion occupies columns [P, P + N) of every row, N = max_new_tokens.
The trainer re-scores `out.tokens` with `mask_BT=out.attention_mask` and reads the completion
columns; `token_logprobs`' alignment (logp[:, t] scores tokens[:, t]) makes the columns line up.

One program (`_decode`, jitted by `_decode_program`) serves every caller: `generate` places its
inputs on a `ShardingPlan` (one device is the trivial plan) and the program's outputs come out in
the plan's layout; `generate_in_jit` traces the same program inside a caller's jit, unplaced. The
policy's deterministic weight quantizers are applied once, at the top of the program
(`weights.quantize_weights`), not in the prefill and again at every decode step, and so are the
casts of the kernels to the compute dtype (`weights.cast_kernels`).

Compute only on tokens that count (docs/sampling.md, "Rollout compute"): rows in groups of one
prompt share one prefill (`_prefill`, `prefill_group`), and the decode can shrink to halving
buckets of the live rows as rows finish (`bucket_sizes`, `_compact`); every row draws the noise it
draws otherwise and the outputs keep the row order.
"""
from __future__ import annotations

import contextlib
import functools
import warnings
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from lowrl import distributed, sharding
from lowrl.models import blocks, transformer
from lowrl.models.config import ModelConfig
from lowrl.models.row_sharding import constrain_rows, constrain_rows_tree
from lowrl.precision import PrecisionPolicy
from lowrl.sampling import weights
from lowrl.sampling.act_scales import check_row_local, used_act_amax
from lowrl.sampling.distributions import SamplingConfig, sample_token
from lowrl.sharding import ShardingPlan

Params = Any


@struct.dataclass
class SampleOutput:
  """Finished rollouts. L = P + N; every array is [B, L] unless noted.

  Attributes:
    tokens: int32. Columns [0, P): the prompt, left-padded with pad_id. Columns [P, L): the
      completion, pad_id after the stop token (or after N tokens).
    prompt_mask: float32 1 on prompt tokens.
    completion_mask: float32 1 on generated tokens up to and including the stop token.
    logprobs: float32 log q(token) of the sampling distribution on completion tokens, else 0.
    model_logprobs: float32 log p(token) of the raw model on completion tokens, else 0.
    prompt_lengths: [B] int32.
    completion_lengths: [B] int32, = completion_mask.sum(-1).
    prompt_width: P (static), the first completion column.
    routing: MoE models recording their routing (lowrl/sampling/replay.py): the sampler's
      expert choices {"layers_i": int32 [B, L, k]}; None otherwise.
  """

  tokens: jax.Array
  prompt_mask: jax.Array
  completion_mask: jax.Array
  logprobs: jax.Array
  model_logprobs: jax.Array
  prompt_lengths: jax.Array
  completion_lengths: jax.Array
  prompt_width: int = struct.field(pytree_node=False, default=0)
  routing: Any = None

  @property
  def attention_mask(self) -> jax.Array:
    """prompt_mask + completion_mask: the mask_BT to re-score `tokens` with."""
    return self.prompt_mask + self.completion_mask


class DecodeState(NamedTuple):
  """The decode loop's carry; the completion arrays are [B, N], column i = completion token i."""

  step: jax.Array  # int32 scalar: the completion column written next
  tokens_BN: jax.Array  # int32, pad_id where not yet written or after the stop token
  logq_BN: jax.Array  # float32 log q(token), 0 off the completion
  logp_BN: jax.Array  # float32 log p(token), 0 off the completion
  live_BN: jax.Array  # bool: the completion mask (up to and including the stop token)
  done_B: jax.Array  # bool: the row has emitted a stop token
  cache: transformer.Cache  # of the decode bucket's rows: [b, S, ...] (b = B uncompacted)
  rows_b: jax.Array | None = None  # int32 [b]: each bucket slot's row; None = every row in order


def left_align(tokens_BP: jax.Array, mask_BP: jax.Array, pad_id: int
               ) -> tuple[jax.Array, jax.Array]:
  """Moves each row's real tokens (order kept) to the right end; padding (pad_id) to the left."""
  mask = mask_BP.astype(bool)
  order = jnp.argsort(mask.astype(jnp.int32), axis=-1, stable=True)
  mask = jnp.take_along_axis(mask, order, axis=-1)
  tokens = jnp.where(mask, jnp.take_along_axis(tokens_BP, order, axis=-1), pad_id)
  return tokens.astype(jnp.int32), mask


def _fold(key, i):
  return None if key is None else jax.random.fold_in(key, i)


def _record(state: DecodeState, i, tok_b, logq_b, logp_b, config: SamplingConfig,
            stop: jax.Array) -> DecodeState:
  """Writes completion column i of the bucket's rows still live (pad_id and 0 in the others);
  a slot writes its own row (`rows_b`), so the outputs stay in the original row order."""
  rows = slice(None) if state.rows_b is None else state.rows_b
  done_b = state.done_B[rows]
  live = ~done_b
  tok_b = jnp.where(live, tok_b, config.pad_id)
  return state._replace(
      tokens_BN=state.tokens_BN.at[rows, i].set(tok_b),
      logq_BN=state.logq_BN.at[rows, i].set(jnp.where(live, logq_b, 0.0)),
      logp_BN=state.logp_BN.at[rows, i].set(jnp.where(live, logp_b, 0.0)),
      live_BN=state.live_BN.at[rows, i].set(live),
      done_B=state.done_B.at[rows].set(done_b | (live & jnp.isin(tok_b, stop))))


def _constrain_state(state: DecodeState) -> DecodeState:
  """The loop carry's rows pinned to their shards (the cache's index is a scalar, left alone;
  a scanned model's stacked [L, B, ...] cache has its rows second)."""
  cache = state.cache
  layers = cache["layers"]
  if isinstance(layers, dict):  # stacked [L, B, S, K, hd]
    layers = constrain_rows_tree(layers, axis=1)
  else:
    layers = constrain_rows_tree(layers)
  cache = {**cache, "mask": constrain_rows(cache["mask"]), "layers": layers}
  rows = constrain_rows_tree(state._replace(step=None, cache=None))
  return rows._replace(step=state.step, cache=cache)


def bucket_sizes(batch: int, shards: int, min_rows: int, per_halving: int = 1
                 ) -> tuple[int, ...]:
  """Decode bucket sizes: `batch` halved while each of the `shards` data shards keeps at least
  `min_rows` rows (and a whole number of them); (batch,) when `min_rows` is 0 (no compaction).

  `per_halving` = k > 1: k buckets per halving, rows per shard round(b 2^(-j / k)) (distinct,
  >= `min_rows`): a bucket then holds at most 2^(1/k) x the live rows instead of 2x, for k times
  as many decode segments (each its own compiled copy of the decode step)."""
  if per_halving < 1:
    raise ValueError(f"per_halving={per_halving} must be >= 1 (1 = halving buckets).")
  if per_halving > 1 and min_rows and batch % shards == 0:
    per = batch // shards
    rows = sorted({round(per * 2 ** (-j / per_halving)) for j in range(64)} - {0}, reverse=True)
    return tuple(r * shards for r in rows if r >= min(min_rows, per))
  sizes = [batch]
  while min_rows and sizes[-1] % (2 * shards) == 0 and sizes[-1] // (2 * shards) >= min_rows:
    sizes.append(sizes[-1] // 2)
  return tuple(sizes)


def _live_per_shard(state: DecodeState, shards: int) -> jax.Array:
  """The most live rows any data shard's part of the bucket holds."""
  live_b = ~state.done_B[state.rows_b]
  return live_b.reshape(shards, -1).sum(-1).max()


def _compact(state: DecodeState, size: int, shards: int) -> DecodeState:
  """The bucket shrunk to `size` slots: on every data shard its live rows first (in slot order),
  their rows' cache entries gathered on the shard (no row crosses a device)."""
  b = state.rows_b.shape[0]
  per, keep = b // shards, size // shards
  live_Sb = (~state.done_B[state.rows_b]).reshape(shards, per)
  order_Sk = jnp.argsort(~live_Sb, axis=-1, stable=True)[:, :keep]

  def take(x, axis=0):  # slots order_Sk of each shard's block of rows along `axis`
    x = jnp.moveaxis(x, axis, 0)
    x = x.reshape((shards, per) + x.shape[1:])
    x = jax.vmap(lambda xs, idx: xs[idx])(x, order_Sk).reshape((size,) + x.shape[2:])
    return constrain_rows(jnp.moveaxis(x, 0, axis), axis)

  cache = state.cache
  row_axis = 1 if isinstance(cache["layers"], dict) else 0  # stacked [L, B, S, K, hd]
  cache = {**cache, "mask": take(cache["mask"]),
           "layers": jax.tree.map(lambda x: take(x, row_axis), cache["layers"])}
  return state._replace(rows_b=take(state.rows_b), cache=cache)


def _group_firsts(x: jax.Array, group: int, axis: int = 0) -> jax.Array:
  """Every `group`-th row of `x` along `axis` (the first row of each group), rows pinned."""
  shape = x.shape
  x = x.reshape(shape[:axis] + (shape[axis] // group, group) + shape[axis + 1:])
  return constrain_rows(jnp.take(x, 0, axis=axis + 1), axis)


def _prefill(params, prompt_BP, pmask_BP, cache, quant_key, act_amax, *, model_cfg: ModelConfig,
             policy: PrecisionPolicy, group: int) -> tuple[jax.Array, transformer.Cache]:
  """FP32 logits [B, V] at every row's last prompt token (column P - 1, where every left-aligned
  prompt ends: the LM head runs for that column only) and the cache holding the prompts' K/V.

  `group` > 1 (shared prefill): rows come in contiguous groups of `group` identical prompts. Each
  group's prompt runs through the model once, into a cache of U = B / group rows and P columns,
  whose K/V, mask and last-column logits are then copied to the group's rows: the decode sees the
  cache and logits a per-row prefill would write, up to the rounding of a U-row vs a B-row
  program (tests/sampling/test_shared_prefill.py), at 1 / group of the prefill's compute.
  """
  positions = transformer.positions_from_mask
  if group == 1:
    logits_B1V, cache = transformer.forward_with_cache(
        params, prompt_BP, cache, model_cfg, policy, mask_BT=pmask_BP,
        positions_BT=positions(pmask_BP), quant_key=quant_key, last_only=True, act_amax=act_amax)
    return logits_B1V[:, 0], cache
  prompt_UP, pmask_UP = _group_firsts(prompt_BP, group), _group_firsts(pmask_BP, group)
  u, p = prompt_UP.shape
  row_axis = 1 if isinstance(cache["layers"], dict) else 0  # stacked [L, B, S, K, hd]
  small = {"index": cache["index"], "mask": jnp.zeros((u, p), bool),
           "layers": jax.tree.map(lambda x: jnp.zeros(
               x.shape[:row_axis] + (u, p) + x.shape[row_axis + 2:], x.dtype), cache["layers"])}
  logits_U1V, small = transformer.forward_with_cache(
      params, prompt_UP, small, model_cfg, policy, mask_BT=pmask_UP,
      positions_BT=positions(pmask_UP), quant_key=quant_key, last_only=True, act_amax=act_amax)

  def spread(full, part, axis=0):  # the U rows' P columns into every row of their group
    rows = constrain_rows(jnp.repeat(part, group, axis=axis), axis)
    return constrain_rows(jax.lax.dynamic_update_slice_in_dim(full, rows, 0, axis=axis + 1), axis)

  cache = {"index": small["index"], "mask": spread(cache["mask"], small["mask"]),
           "layers": jax.tree.map(lambda f, s: spread(f, s, row_axis), cache["layers"],
                                  small["layers"])}
  return constrain_rows(jnp.repeat(logits_U1V[:, 0], group, axis=0)), cache


def rounds_row_locally(policy: PrecisionPolicy) -> bool:
  """Whether the policy's forward rounds every row on its own: no stochastic rounding, whose
  noise (one draw over the whole activation) would follow a row's slot in a smaller batch."""
  return not any(q is not None and q.stochastic_rounding
                 for _, c in policy.rules for q in (c.lhs, c.rhs))


def decode_min_rows(min_rows: int, policy: PrecisionPolicy) -> int:
  """The compaction's smallest bucket (rows per shard) `generate` runs: `min_rows`, or 0 (no
  compaction) for a policy that does not round row-locally (`rounds_row_locally`)."""
  if min_rows < 0:
    raise ValueError(f"decode_min_rows={min_rows} must be >= 0 (0 = no compaction).")
  return min_rows if rounds_row_locally(policy) else 0


def prefill_group(batch: int, group_size: int, shards: int, policy: PrecisionPolicy) -> int:
  """The rows that share one prefill: the largest divisor g of `group_size` whose B / g prompts
  split evenly over the `shards` data shards (each device then prefills whole groups of its own
  rows), or 1 (per-row prefill) when the policy rounds stochastically (rows sharing one prefill
  would share its rounding noise, which a per-row prefill draws for each row)."""
  if group_size < 1 or batch % group_size:
    raise ValueError(f"group_size={group_size} must be >= 1 and divide the batch ({batch} rows).")
  if not rounds_row_locally(policy):
    return 1
  return max(g for g in range(1, group_size + 1)
             if group_size % g == 0 and (batch // g) % shards == 0)


def _decode(params, prompt_BP, prompt_mask_BP, rng, cache, quant_key, act_amax, greedy=None, *,
            model_cfg: ModelConfig, policy: PrecisionPolicy, config: SamplingConfig,
            plan: ShardingPlan | None = None, group: int = 1, min_rows: int = 0,
            per_halving: int = 1) -> tuple[SampleOutput, transformer.Cache]:
  """Prefill + decode loop (traceable). With a plan every row's activations, decode state and
  cache stay on its data shard (`plan.rows`: data parallel, no gather of the batch). `group`:
  rows per shared prefill (`_prefill`); `min_rows`: the smallest decode bucket's rows per data
  shard (`bucket_sizes`; 0 = no compaction); `greedy`: `sample_token`'s runtime flag (None:
  none, the program `config` alone describes)."""
  shards = 1 if plan is None else plan.batch_shards
  with plan.rows() if plan is not None else contextlib.nullcontext():
    return _decode_rows(params, prompt_BP, prompt_mask_BP, rng, cache, quant_key, act_amax,
                        greedy, model_cfg=model_cfg, policy=policy, config=config, group=group,
                        min_rows=min_rows, shards=shards, per_halving=per_halving)


def _decode_rows(params, prompt_BP, prompt_mask_BP, rng, cache, quant_key, act_amax, greedy, *,
                 model_cfg: ModelConfig, policy: PrecisionPolicy, config: SamplingConfig,
                 group: int = 1, min_rows: int = 0, shards: int = 1, per_halving: int = 1
                 ) -> tuple[SampleOutput, transformer.Cache]:
  """`_decode` inside its row context."""
  batch, p = prompt_BP.shape
  n = config.max_new_tokens
  prompt_BP, pmask_BP = left_align(prompt_BP, prompt_mask_BP, config.pad_id)
  plen_B = pmask_BP.sum(-1).astype(jnp.int32)
  stop = jnp.asarray(config.stop_tokens or (-1,), jnp.int32)
  # Reuse the donated k/v buffers as they are: a column is written before any query can see it
  # (causal over columns), so stale values get softmax weight exactly 0. Reset index and mask.
  cache = {**cache, "index": jnp.zeros((), jnp.int32), "mask": jnp.zeros_like(cache["mask"])}
  # The one place weights are quantized ahead of time: once per call, not per decode step.
  params, policy = weights.quantize_weights(params, model_cfg, policy)
  # Likewise the casts of the kernels the forward only casts: XLA hoists them out of some decode
  # loops but not all (the main job's compaction segments).
  params = weights.cast_kernels(params, model_cfg, policy)

  logits_BV, cache = _prefill(params, prompt_BP, pmask_BP, cache, quant_key, act_amax,
                              model_cfg=model_cfg, policy=policy, group=group)
  tok_B, logq_B, logp_B = sample_token(jax.random.fold_in(rng, 0), logits_BV, config,
                                       greedy=greedy)
  state = DecodeState(
      step=jnp.int32(1), tokens_BN=jnp.full((batch, n), config.pad_id, jnp.int32),
      logq_BN=jnp.zeros((batch, n), jnp.float32), logp_BN=jnp.zeros((batch, n), jnp.float32),
      live_BN=jnp.zeros((batch, n), bool), done_B=jnp.zeros((batch,), bool), cache=cache)
  state = _record(state, 0, tok_B, logq_B, logp_B, config, stop)
  state = _constrain_state(state)

  def body(state: DecodeState) -> DecodeState:
    i = state.step
    rows = slice(None) if state.rows_b is None else state.rows_b
    prev_b1 = jax.lax.dynamic_slice_in_dim(state.tokens_BN, i - 1, 1, axis=1)[rows]
    prev_live_b1 = jax.lax.dynamic_slice_in_dim(state.live_BN, i - 1, 1, axis=1)[rows]
    logits_b1V, cache = transformer.forward_with_cache(
        params, prev_b1, state.cache, model_cfg, policy, mask_BT=prev_live_b1,
        positions_BT=(plen_B[rows] + i - 1)[:, None], quant_key=_fold(quant_key, p + i - 1),
        act_amax=act_amax)
    tok_b, logq_b, logp_b = sample_token(jax.random.fold_in(rng, i), logits_b1V[:, 0], config,
                                         state.rows_b, batch, greedy)
    state = state._replace(step=i + 1)
    return _constrain_state(
        _record(state, i, tok_b, logq_b, logp_b, config, stop)._replace(cache=cache))

  sizes = bucket_sizes(batch, shards, min_rows, per_halving)
  if len(sizes) == 1:  # one bucket: every row decodes until the last one stops
    state = jax.lax.while_loop(lambda s: (s.step < n) & ~jnp.all(s.done_B), body, state)
    return _outputs(state, prompt_BP, pmask_BP, plen_B, p), state.cache
  # Compaction: a decode segment per bucket size, each running while some shard's live rows
  # outnumber its share of the next (half-size, or 2^(-1/k)) bucket; between segments the live
  # rows move to the front and the bucket shrinks, so finished rows stop costing decode compute.
  state = state._replace(rows_b=constrain_rows(jnp.arange(batch, dtype=jnp.int32)))
  full_cache = None
  for k, size in enumerate(sizes):
    nxt = sizes[k + 1] // shards if k + 1 < len(sizes) else 0
    state = jax.lax.while_loop(
        lambda s, nxt=nxt: (s.step < n) & (_live_per_shard(s, shards) > nxt), body, state)
    if k == 0:
      full_cache = state.cache  # handed back for the next call (its contents are not reused)
    if nxt:
      state = _compact(state, sizes[k + 1], shards)
  return _outputs(state, prompt_BP, pmask_BP, plen_B, p), full_cache


def _outputs(state: DecodeState, prompt_BP, pmask_BP, plen_B, p: int) -> SampleOutput:
  """The SampleOutput of a finished decode (every array in the original row order)."""
  batch, n = state.tokens_BN.shape
  zeros_BP = jnp.zeros((batch, p), jnp.float32)
  return SampleOutput(
      tokens=jnp.concatenate([prompt_BP, state.tokens_BN], axis=1),
      prompt_mask=jnp.concatenate([pmask_BP.astype(jnp.float32), jnp.zeros((batch, n))], axis=1),
      completion_mask=jnp.concatenate([zeros_BP, state.live_BN.astype(jnp.float32)], axis=1),
      logprobs=jnp.concatenate([zeros_BP, state.logq_BN], axis=1),
      model_logprobs=jnp.concatenate([zeros_BP, state.logp_BN], axis=1),
      prompt_lengths=plen_B,
      completion_lengths=state.live_BN.sum(-1).astype(jnp.int32),
      prompt_width=p)


def _decode_program(model_cfg: ModelConfig, policy: PrecisionPolicy, config: SamplingConfig,
                    plan: ShardingPlan | None, group: int = 1, min_rows: int = 0,
                    per_halving: int = 1):
  """`_decode` jitted for one static setting, the cache (argument 4) donated. With a plan, the
  outputs come out in its layout (rollouts over the batch axes, the cache as
  `plan.cache_shardings`) and the inputs arrive placed by `generate`; None: placed by the caller
  (`generate_in_jit`, inside the caller's jit). One program per setting however the caller
  spells it: the defaults are filled in before the cache (`_decode_jit`) sees the arguments,
  since an lru_cache keys on the arguments as passed."""
  return _decode_jit(model_cfg, policy, config, plan, group, min_rows, per_halving)


@functools.lru_cache(maxsize=64)
def _decode_jit(model_cfg: ModelConfig, policy: PrecisionPolicy, config: SamplingConfig,
                plan: ShardingPlan | None, group: int, min_rows: int, per_halving: int):
  """`_decode_program`'s cache: every argument explicit, so one setting is one entry."""
  layout_kw = {} if plan is None else {
      "out_shardings": (plan.batch, plan.cache_shardings(model_cfg))}
  note = None if plan is None else plan.cache_note(model_cfg)
  if note:  # once per program (cached), before it compiles
    warnings.warn(note, stacklevel=4)
  return jax.jit(functools.partial(_decode, model_cfg=model_cfg, policy=policy, config=config,
                                   plan=plan, group=group, min_rows=min_rows,
                                   per_halving=per_halving),
                 donate_argnums=(4,), **layout_kw)


# The cache's statistics and reset where callers look for them (tests count compiled programs).
_decode_program.cache_info = _decode_jit.cache_info  # type: ignore[attr-defined]
_decode_program.cache_clear = _decode_jit.cache_clear  # type: ignore[attr-defined]


@functools.lru_cache(maxsize=64)
def _cache_allocator(model_cfg: ModelConfig, batch: int, length: int, dtype: Any,
                     plan: ShardingPlan):
  """Allocates an empty KV cache directly in `plan`'s layout (never whole on one device)."""
  return jax.jit(lambda: transformer.init_cache(model_cfg, batch, length, dtype),
                 out_shardings=plan.cache_shardings(model_cfg))


def generate_in_jit(params: Params, prompt_BP: jax.Array, prompt_mask_BP: jax.Array,
                    rng: jax.Array, *, model_cfg: ModelConfig, policy: PrecisionPolicy,
                    config: SamplingConfig, quant_key: jax.Array | None = None,
                    act_amax: blocks.ActAmax | None = None, group_size: int = 1,
                    min_rows: int = 0) -> SampleOutput:
  """`generate` as a traceable function, for callers already inside a jit (the simulator's scan).

  No host-side checks (run `config.check`, `check_row_local` before tracing; with `group_size`
  > 1 the caller promises groups of identical prompts) and no placement (the caller's jit
  places); it allocates its own KV cache. The program `generate` runs.
  """
  batch, p = prompt_BP.shape
  params, policy = weights.dequantize_packed(params, model_cfg, policy)
  cache = transformer.init_cache(model_cfg, batch, p + config.max_new_tokens, policy.dtype)
  group = prefill_group(batch, group_size, 1, policy)
  out, _ = _decode_program(model_cfg, policy, config, None, group,
                           decode_min_rows(min_rows, policy))(
      params, prompt_BP, prompt_mask_BP, rng, cache, quant_key, act_amax)
  return out


def _check_inputs(prompt_BP, prompt_mask_BP, model_cfg, config, group_size=1):
  if prompt_BP.ndim != 2 or prompt_BP.shape != prompt_mask_BP.shape:
    raise ValueError(f"prompt tokens {prompt_BP.shape} and prompt mask {prompt_mask_BP.shape} "
                     "must both be [B, P].")
  config.check(model_cfg)
  length = prompt_BP.shape[1] + config.max_new_tokens
  if length > model_cfg.max_seq_len:
    raise ValueError(f"P + max_new_tokens = {length} exceeds model_cfg.max_seq_len="
                     f"{model_cfg.max_seq_len}; shorten the prompts or max_new_tokens.")
  lengths = distributed.to_host(prompt_mask_BP).astype(bool).sum(-1)
  if lengths.min() < 1:
    raise ValueError(f"rows {np.flatnonzero(lengths < 1).tolist()} have empty prompts; every row "
                     "needs at least one prompt token (e.g. a BOS id).")
  if group_size > 1:  # shared prefill: every group's rows must hold one prompt
    if prompt_BP.shape[0] % group_size:
      raise ValueError(f"group_size={group_size} does not divide the batch "
                       f"({prompt_BP.shape[0]} rows); pass rows in whole groups or group_size=1.")
    mask = distributed.to_host(prompt_mask_BP).astype(bool)
    toks = np.where(mask, distributed.to_host(prompt_BP), 0)
    for a in (mask, toks):
      a = a.reshape(-1, group_size, a.shape[1])
      bad = np.flatnonzero(~(a == a[:, :1]).all(axis=(1, 2)))
      if bad.size:
        raise ValueError(f"group_size={group_size}: the rows of prompt groups {bad.tolist()} "
                         "differ; groups must be contiguous rows of one prompt (padded alike), "
                         "or pass group_size=1.")


def generate(params: Params, prompt_tokens_BP: jax.Array, prompt_mask_BP: jax.Array,
             rng: jax.Array, *, model_cfg: ModelConfig, policy: PrecisionPolicy,
             config: SamplingConfig, quant_key: jax.Array | None = None,
             cache: transformer.Cache | None = None, plan: ShardingPlan | None = None,
             act_amax: blocks.ActAmax | None = None, group_size: int = 1, min_rows: int = 0,
             greedy: bool | None = None, buckets_per_halving: int = 1
             ) -> tuple[SampleOutput, transformer.Cache]:
  """Samples N = config.max_new_tokens tokens per prompt with the KV cache (not exact mode).

  Args:
    params, model_cfg, policy: the sampler's model (may differ from the trainer's). params may
      be master weights or a `pack_params` tree (dequantized here; the policy then skips the
      weight quantizers those kernels went through).
    prompt_tokens_BP, prompt_mask_BP: prompts padded on either side; >= 1 real token per row.
    rng: sampling key (step i uses fold_in(rng, i): deterministic given rng).
    quant_key: stochastic-rounding key (the step writing column c uses fold_in(quant_key, c)).
    cache: a cache from an earlier call of the same shapes, or from
      `transformer.init_cache(model_cfg, B, P + N, policy.dtype)`; donated (do not reuse the
      argument). None allocates one.
    plan: run on this mesh: params as `plan.param_shardings`, prompts, outputs and the KV cache
      split over the batch axes (the cache's kv heads as k_proj's columns); inputs placed
      otherwise are moved there first. None: `sharding.single_device_plan()`.
    act_amax: static calibrated amaxes of the activations `policy` scales per tensor (required
      for such a policy; see `check_row_local`), stored with the rollout weights.
    group_size: rows come in contiguous groups of this many identical prompts (GRPO's groups;
      checked): each group's prompt is prefilled once and its K/V shared by the group's rows
      (`prefill_group` picks the rows per prefill on the plan's data shards). The same
      per-row sampling keys: the distribution sampled is unchanged.
    min_rows: > 0 compacts the decode: as rows finish, the live ones move into buckets of half
      the rows, down to `min_rows` rows per data shard (`bucket_sizes`), each bucket a decode
      segment of its own, so finished rows stop costing compute; every row draws the noise it
      draws uncompacted, and the outputs keep the original row order. 0: one bucket.
    buckets_per_halving: k > 1 shrinks the buckets by 2^(1/k) instead of 2 (`bucket_sizes`):
      less compute on finished rows, k times the decode segments to compile.
    greedy: a runtime choice between `config`'s draw (False) and temperature 0 (True), each what
      the static config gives bit for bit, both in one compiled program (evaluation's greedy and
      sampled decodes share it); None (default): `config` alone, a program without the choice.

  Returns:
    (SampleOutput, the cache's buffers for the next call).
  """
  _check_inputs(prompt_tokens_BP, prompt_mask_BP, model_cfg, config, group_size)
  check_row_local(policy, model_cfg, act_amax)
  act_amax = used_act_amax(policy, model_cfg, act_amax)
  plan = plan or sharding.single_device_plan()
  batch, p = prompt_tokens_BP.shape
  plan.check_batch(batch, "the sampler's batch (prompts)")
  params, policy = weights.dequantize_packed(params, model_cfg, policy)
  if cache is None:
    cache = _cache_allocator(model_cfg, batch, p + config.max_new_tokens, policy.dtype, plan)()
  batch_sh, repl = plan.batch, plan.replicated
  greedy = None if greedy is None else jnp.asarray(greedy, bool)
  args = plan.put(
      (params, jnp.asarray(prompt_tokens_BP, jnp.int32), jnp.asarray(prompt_mask_BP), rng, cache,
       quant_key, act_amax, greedy),
      (plan.param_shardings(params), batch_sh, batch_sh, repl, plan.cache_shardings(model_cfg),
       repl, repl, repl))
  group = prefill_group(batch, group_size, plan.batch_shards, policy)
  return _decode_program(model_cfg, policy, config, plan, group,
                         decode_min_rows(min_rows, policy), buckets_per_halving)(*args)
