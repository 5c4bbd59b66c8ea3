"""The loop's routing replay (MoE models): the trainer's scores of a rollout and the flip metric.

With `rl.routing_replay` the trainer's pi_old (and the stale score of the drift split) replay the
sampler's recorded routing (`SampleOutput.routing`), as the update's logprob function then does;
without it they are the loop's usual exact-mode scoring program (`Trainer.score`). Either way
one more forward gives what the trainer's own routers choose, for `routing/flips`: the fraction
of (completion token, MoE layer) whose top-k expert set differs from the sampler's record
(with replay: what the trainer would have chosen in its replayed forward).
"""
from __future__ import annotations

from typing import Any

import jax

from lowrl.sampling import SampleOutput, replay

def trainer_scores(trainer: Any, out: SampleOutput, sampler_params: Any, params: Any,
                   key: jax.Array, stale: bool
                   ) -> tuple[jax.Array, jax.Array, dict[str, jax.Array]]:
  """(pi_old [B, L], the stale weights' trainer-precision score [B, L], {"routing/flips"}) of a
  `lowrl.training.trainer.Trainer` (not imported: the trainer builds on this module).

  pi_old is the sampler's record where `Trainer.sampler_scored_pi_old` proves it identical.
  """
  setup = trainer.setup
  policy, on = setup.trainer_policy, setup.loop.routing_replay
  qk = policy.quant_key(key)

  def routed(p, replayed):
    return replay.score(out, p, model_cfg=setup.model_cfg, policy=policy, config=setup.sampling,
                        replay=replayed, quant_key=qk, plan=trainer.plan,
                        pack=setup.update_cfg.pack)

  recorded = trainer.sampler_scored_pi_old(sampler_params, params, stale)
  logq_now, own = routed(params, on)
  if on:
    logp_now = out.logprobs if recorded else logq_now
    logp_stale = routed(sampler_params, True)[0] if stale else logp_now
  else:
    logp_now = out.logprobs if recorded else trainer.score(params, policy, out, key)
    logp_stale = trainer.score(sampler_params, policy, out, key) if stale else logp_now
  return logp_now, logp_stale, replay.flip_metrics(out, own)
