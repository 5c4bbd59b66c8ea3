"""The weight sync of a LoRA run: the frozen base quantized (packed) once, then only the adapters.

`AdapterRefitter` is the sampler's side (`refit.Refitter`) when the trainer's params carry LoRA
adapters (lowrl.models.lora). Its first sync quantizes and packs the whole tree, as a full
fine-tuning run's every sync does; it keeps that base (the packed kernels and their scales, and
the unquantized leaves) and each later sync replaces the adapters alone, with the static
activation scales recalibrated on the new weights (they depend on the adapters). What a sync
moves is logged as `refit/sync_bytes`: the adapters plus the scales, after the first.

The refit check is the Refitter's: every held tensor, the base's packed codes and scales and
the adapters, against a fresh quantization of the trainer's whole tree, bit for bit; a base that
moved (it must not: the update never writes it) shows up there.
"""
from __future__ import annotations

import re

import jax
import jax.numpy as jnp

from lowrl.models import layout, lora
from lowrl.sampling.refit import Params, Refitter, RolloutWeights


class AdapterRefitter(Refitter):
  """`Refitter` that moves only the adapters after its first sync (module docstring)."""

  def __init__(self, *args, moves: str | None = None, **kwargs):
    """`moves`: a regex over the full paths of base leaves that later syncs move too (AQN's
    noisy RMSNorm weights, lowrl.training.aqn.NORMS); None = the adapters alone."""
    super().__init__(*args, **kwargs)
    self._base: Params | None = None
    self._moves = moves
    self.sync_bytes: int | None = None  # what the newest sync moved

  def quantize(self, params: Params) -> RolloutWeights:
    base, adapters = lora.split(params)
    if self._base is None:
      full = super().quantize(params)
      # Own buffers: the update donates the trainer's params, whose unquantized leaves a
      # jitted pack may hand back as they are.
      self._base = jax.tree.map(jnp.copy, lora.split(full.weights)[0])
      self.sync_bytes = lora.tree_bytes(full)
      return full
    base_moved = 0
    if self._moves is not None:  # these base leaves change between syncs (unquantized norms)
      for path, leaf in jax.tree_util.tree_flatten_with_path(base)[0]:
        if re.fullmatch(self._moves, jax.tree_util.keystr(path, simple=True, separator="/")):
          self._base = layout.set_param(self._base, [k.key for k in path], jnp.copy(leaf))
          base_moved += int(leaf.nbytes)
    held = RolloutWeights(lora.merge(self._base, jax.tree.map(jnp.copy, adapters)),
                          self._act_amax(params))
    self.sync_bytes = (lora.tree_bytes(adapters) + lora.tree_bytes(held.act_amax)
                       + base_moved)
    return held

  def __call__(self, params: Params, version: int | None
               ) -> tuple[RolloutWeights, dict[str, float]]:
    held, metrics = super().__call__(params, version)
    return held, {**metrics, "refit/sync_bytes": float(self.sync_bytes)}
