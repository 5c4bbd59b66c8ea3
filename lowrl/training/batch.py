"""The RL update's batch (`RLBatch`): built by the step (`lowrl.training.step.make_batch`),
consumed by the update (`lowrl.training.rl_update`); a leaf of the training package."""
from __future__ import annotations

from typing import Any, NamedTuple

import jax


class RLBatch(NamedTuple):
  """The update's batch; every array [B, T] is aligned so that column t refers to token t.

  tokens_BT:       int32, prompt + completion (+ padding).
  input_mask_BT:   float32, 1 on real (non-padding) tokens.
  loss_mask_BT:    float32, 1 on completion tokens that count in the loss.
  logp_sampler_BT: float32, log q_sampler of token t as the sampler recorded it (0 off the
                   completion): the behaviour distribution.
  adv_B:           float32 per-sequence advantages.
  logp_trainer_BT: float32 or None: the trainer's log q of the same tokens with the params that
                   start the update (pi_old); None = the update recomputes it in its own program.
  routing:         MoE routing replay: the sampler's expert choices {"layers_i": int32 [B, T, k]}
                   (`SampleOutput.routing`), which a replaying logprob function reuses; None
                   = the trainer routes as its own routers choose.
  """

  tokens_BT: jax.Array
  input_mask_BT: jax.Array
  loss_mask_BT: jax.Array
  logp_sampler_BT: jax.Array
  adv_B: jax.Array
  logp_trainer_BT: jax.Array | None = None
  routing: Any = None
