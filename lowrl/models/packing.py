"""Packed rows for the update and scoring: sequences (their real tokens, no padding) placed into
rows of a fixed width by first fit, inside the jitted program (static shapes, no host sync).

A batch [B, T] (left-padded prompt + completion + right padding, `RLBatch`) is split into S data
shards of b = B / S rows (the blocks the mesh gives each device). Each shard packs its own
sequences into b rows of L >= T columns (`PackConfig.row_tokens`; b rows always suffice: every
sequence fits a row), in
row order, each into the first row with room (`plan`). A packed row holds several sequences
one after another, told apart by segment ids (1 + the sequence's row within its shard; 0 =
padding); attention stays within a segment and positions restart at 0 per segment
(`lowrl.models.transformer.model_inputs`), so each token sees exactly the keys and position it
has in its padded row. Shard s's packed rows only hold shard s's sequences: gathers and
scatters are batched over the shard axis (no row crosses a device).

Micro-batch j is packed rows [j m, (j + 1) m) of every shard (m = rows per shard per
micro-batch); only the first `PackPlan.micro_batches` (a traced count: the fullest shard's rows
/ m, rounded up) are computed. Per-token results come back to the padded [B, T] layout
(`unpack`), where the loss and every metric are computed exactly as on the padded path.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class PackConfig:
  """Static packing settings (hashable): rows of `row_tokens` columns (>= the batch's width T),
  micro-batches of `rows` packed rows per data shard (rl.pack_tokens, rl.pack_rows)."""

  row_tokens: int
  rows: int = 1

  def __post_init__(self):
    if self.row_tokens < 1 or self.rows < 1:
      raise ValueError(f"packing needs row_tokens >= 1 and rows >= 1, got {self}.")

  def layout(self, batch: int, width: int, shards: int) -> tuple[int, int]:
    """(row width, rows per shard per micro-batch) for a [batch, width] batch on `shards`."""
    if self.row_tokens < width:
      raise ValueError(f"rl.pack_tokens={self.row_tokens} is smaller than the longest sequence "
                       f"({width} tokens); raise it to >= {width}, or 0 (padded rows).")
    return self.row_tokens, min(self.rows, batch // shards)


class PackPlan(NamedTuple):
  """Where each token goes; arrays are per shard ([S, ...]), indices local to the shard.

  src_SN:      int32 [S, b * L]: the packed slot's source in the shard's flattened [b * T]
               batch; b * T (one past the end) = padding.
  segment_SN:  int32 [S, b * L]: segment ids (0 = padding).
  positions_SN: int32 [S, b * L]: RoPE positions (0, 1, ... per segment).
  dest_SM:     int32 [S, b * T]: each padded slot's packed slot (flattened [b * L]); b * L =
               not a real token.
  rows_used:   int32 scalar: packed rows in use in the fullest shard.
  """

  src_SN: jax.Array
  segment_SN: jax.Array
  positions_SN: jax.Array
  dest_SM: jax.Array
  rows_used: jax.Array


class PackedTokens(NamedTuple):
  """A micro-batch of packed rows, as a `make_logprob_fn` function reads it."""

  tokens_BT: jax.Array
  input_mask_BT: jax.Array  # float32 1 on real tokens
  segment_ids_BT: jax.Array
  positions_BT: jax.Array
  routing: Any = None


def _first_fit(lengths_b: jax.Array, width: int) -> tuple[jax.Array, jax.Array]:
  """(row, offset) of each sequence placed in order into the first of b rows with room."""
  def place(fill_b, n):
    row = jnp.argmax(fill_b + n <= width)  # a row always has room: n <= width
    return fill_b.at[row].add(n), (row, fill_b[row])

  _, (row_b, off_b) = jax.lax.scan(place, jnp.zeros_like(lengths_b), lengths_b)
  return row_b, off_b


def plan(mask_BT: jax.Array, width: int, shards: int) -> PackPlan:
  """The packing of a batch's real tokens (`mask_BT` > 0) into rows of `width` columns.

  A row's real tokens keep their order (positions = their count before them in the row, as the
  padded forward's `positions_from_mask`). `width` must be >= T (every sequence fits a row).
  """
  batch, steps = mask_BT.shape
  if width < steps:
    raise ValueError(f"packing width {width} is narrower than the batch's {steps} columns.")
  b = batch // shards
  real_SbT = (mask_BT > 0).reshape(shards, b, steps)
  k_SbT = jnp.cumsum(real_SbT.astype(jnp.int32), axis=-1) - 1  # index among the row's tokens
  lengths_Sb = jnp.sum(real_SbT, axis=-1, dtype=jnp.int32)
  row_Sb, off_Sb = jax.vmap(lambda n: _first_fit(n, width))(lengths_Sb)
  slots = b * width
  dest_SbT = jnp.where(real_SbT, row_Sb[..., None] * width + off_Sb[..., None] + k_SbT, slots)
  dest_SM = dest_SbT.reshape(shards, b * steps)

  def scatter(values_SM, fill):  # padded slots' values to their packed slots
    out = jnp.full((shards, slots + 1), fill, jnp.int32)
    return jax.vmap(lambda o, d, v: o.at[d].set(v))(out, dest_SM, values_SM)[:, :slots]

  src_SN = scatter(jnp.broadcast_to(jnp.arange(b * steps, dtype=jnp.int32), (shards, b * steps)),
                   b * steps)
  seg_SN = scatter(jnp.broadcast_to(jnp.repeat(jnp.arange(1, b + 1, dtype=jnp.int32), steps),
                                    (shards, b * steps)), 0)
  pos_SN = scatter(jnp.maximum(k_SbT, 0).reshape(shards, b * steps), 0)
  rows_used = jnp.max(jnp.where(lengths_Sb > 0, row_Sb + 1, 0))
  return PackPlan(src_SN, seg_SN, pos_SN, dest_SM, rows_used)


def micro_batches(pk: PackPlan, rows: int) -> jax.Array:
  """How many micro-batches of `rows` packed rows per shard hold every sequence (traced, >= 1)."""
  return jnp.maximum(-(-pk.rows_used // rows), 1)


def _gather_S(x_SM: jax.Array, idx_SN: jax.Array, fill) -> jax.Array:
  """x_SM[s, idx_SN[s, n]] per shard, `fill` where idx is one past the end."""
  padded = jnp.concatenate([x_SM, jnp.full((x_SM.shape[0], 1) + x_SM.shape[2:], fill,
                                           x_SM.dtype)], axis=1)
  return jax.vmap(lambda a, i: jnp.take(a, i, axis=0))(padded, idx_SN)


def micro_batch(pk: PackPlan, tokens_BT: jax.Array, j: jax.Array, rows: int, width: int,
                routing: Any = None) -> PackedTokens:
  """Packed micro-batch j: [S * rows, width] (each shard's rows [j rows, (j + 1) rows)), with
  the routing replay's expert ids ({"layers_i": [B, T, k]}) gathered alongside."""
  shards = pk.src_SN.shape[0]
  n = rows * width
  take = lambda x: jax.lax.dynamic_slice_in_dim(x, j * n, n, axis=1)  # noqa: E731
  src_SN, seg_SN, pos_SN = take(pk.src_SN), take(pk.segment_SN), take(pk.positions_SN)
  to_rows = lambda x: x.reshape((shards * rows, width) + x.shape[2:])  # noqa: E731
  per_shard = lambda x: x.reshape((shards, -1) + x.shape[2:])  # noqa: E731
  tokens = to_rows(_gather_S(per_shard(tokens_BT), src_SN, 0))
  seg = to_rows(seg_SN)
  if routing is not None:
    routing = jax.tree.map(
        lambda r: to_rows(_gather_S(r.reshape((shards, -1) + r.shape[2:]), src_SN, 0)), routing)
  return PackedTokens(tokens, (seg > 0).astype(jnp.float32), seg, to_rows(pos_SN), routing)


def unpack(pk: PackPlan, values_RL: jax.Array, j: jax.Array, rows: int,
           shape_BT: tuple[int, int]) -> tuple[jax.Array, jax.Array]:
  """(values [S rows, L, ...] in the padded [B, T, ...] layout, float32 [B, T] 1 where
  micro-batch j holds the token); 0 elsewhere."""
  shards = pk.src_SN.shape[0]
  n = values_RL.shape[0] * values_RL.shape[1] // shards
  local_SM = pk.dest_SM - j * n
  inside_SM = (local_SM >= 0) & (local_SM < n)
  out_SM = _gather_S(values_RL.reshape((shards, n) + values_RL.shape[2:]),
                     jnp.where(inside_SM, local_SM, n), 0)
  return (out_SM.reshape(tuple(shape_BT) + values_RL.shape[2:]),
          inside_SM.reshape(shape_BT).astype(jnp.float32))


def packed_scores(score_fn: Callable[[PackedTokens], Any], pk: PackPlan, tokens_BT: jax.Array,
                  rows: int, width: int, routing: Any = None) -> Any:
  """Per-token scores (`score_fn` of a packed micro-batch -> [S rows, width, ...], or a tree of
  such arrays, e.g. MoE expert ids) over the micro-batches in use (a loop of traced length), in
  the padded layout [B, T, ...]; 0 on padding."""
  def body(j, acc):
    mb = micro_batch(pk, tokens_BT, j, rows, width, routing)
    return jax.tree.map(lambda a, v: a + unpack(pk, v, j, rows, tokens_BT.shape)[0], acc,
                        score_fn(mb))

  shapes = jax.eval_shape(score_fn, micro_batch(pk, tokens_BT, jnp.zeros((), jnp.int32), rows,
                                                width, routing))
  zeros = jax.tree.map(lambda s: jnp.zeros(tokens_BT.shape + s.shape[2:], s.dtype), shapes)
  return jax.lax.fori_loop(0, micro_batches(pk, rows), body, zeros)


def scores(score_fn: Callable[[PackedTokens], Any], cfg: PackConfig, tokens_BT: jax.Array,
           mask_BT: jax.Array, shards: int, routing: Any = None) -> Any:
  """`packed_scores` of a batch packed by `cfg` (its own `plan`)."""
  width, rows = cfg.layout(*tokens_BT.shape, shards)
  return packed_scores(score_fn, plan(mask_BT, width, shards), tokens_BT, rows, width, routing)


def padding_fraction(mask_BT: jax.Array, slots: jax.Array) -> jax.Array:
  """1 - real tokens / token slots computed (`slots`: the forward's rows x columns)."""
  return 1.0 - jnp.sum(mask_BT > 0).astype(jnp.float32) / slots.astype(jnp.float32)
