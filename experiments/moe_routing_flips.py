r"""Routing flips of an NVFP4 sampler against a BF16 trainer, with and without routing replay.

A tiny Qwen3-MoE-style model (random init; 8 experts, top-2, renormalised) scores random
sequences under a sampler recipe and under the trainer's BF16 policy. Reported per sampler
recipe, mean and spread over seeds:
  flips      fraction of (token, layer) whose top-k expert set differs between the sampler's
             forward and the trainer's own forward (what replay removes: with replay the
             trainer routes as the sampler did, 0 flips reach the update by construction);
  flips (replay on)  the same fraction against what the trainer's routers would have chosen
             inside the replayed forward (the loop's routing/flips metric with rl.routing_replay);
  |dlogp|    mean |log p_sampler - log p_trainer| over tokens, without and with replay.

  python -m experiments.moe_routing_flips [--seeds=3] [--batch=16] [--length=64]
"""
from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags

from lowrl import precision
from lowrl.models import init, layout, routing
from lowrl.models.config import ModelConfig

_SEEDS = flags.DEFINE_integer("seeds", 3, "model/data seeds")
_BATCH = flags.DEFINE_integer("batch", 16, "sequences per seed")
_LENGTH = flags.DEFINE_integer("length", 64, "tokens per sequence")

MODEL = ModelConfig(vocab_size=256, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16,
                    d_ff=128, qk_norm=True, n_experts=8, n_experts_per_tok=2, moe_d_ff=64,
                    norm_topk_prob=True, max_seq_len=128)


def samplers(ms) -> dict[str, precision.PrecisionPolicy]:
  naive = precision.policy_for("nvfp4_naive", ms)
  quantized_router = precision.prepend_rules(
      naive, ((precision.ROUTER, naive.qdot_config("layers_0/mlp/experts/up_proj")),),
      name="nvfp4_naive+router")
  return {"nvfp4_naive, NVFP4 router": quantized_router,
          "nvfp4_naive, FP32 router": naive,
          "nvfp4_moe_experts (recipe)": precision.policy_for("nvfp4_moe_experts", ms)}


def main(_):
  ms = layout.matmuls(MODEL)
  trainer = precision.policy_for("bf16", ms)
  record = jax.jit(routing.record_routing, static_argnums=(2, 3))
  logprobs = jax.jit(routing.token_logprobs_replayed, static_argnums=(2, 3))
  routed = jax.jit(routing.forward_routed, static_argnums=(2, 3))
  rows: dict[str, list[tuple[float, float, float, float]]] = {}
  for seed in range(_SEEDS.value):
    params = init.init_params(MODEL, jax.random.key(seed))
    tokens = jax.random.randint(jax.random.key(1000 + seed), (_BATCH.value, _LENGTH.value), 0,
                                MODEL.vocab_size)
    _, own = record(params, tokens, MODEL, trainer)
    lp_own = logprobs(params, tokens, MODEL, trainer, None)
    for name, sampler in samplers(ms).items():
      _, used = record(params, tokens, MODEL, sampler)
      lp_sampler = logprobs(params, tokens, MODEL, sampler, None)
      lp_replay = logprobs(params, tokens, MODEL, trainer, used)
      flips = float(routing.routing_flips(used, own)["mean"])
      would = routed(params, tokens, MODEL, trainer, used)[1]
      rows.setdefault(name, []).append(
          (flips, float(routing.routing_flips(used, would)["mean"]),
           float(jnp.abs(lp_sampler - lp_own)[:, 1:].mean()),
           float(jnp.abs(lp_sampler - lp_replay)[:, 1:].mean())))
  print(f"{'sampler (trainer: bf16)':<30} {'flips':>16} {'flips (replay on)':>20} "
        f"{'|dlogp| no replay':>20} {'|dlogp| replay':>20}")
  out = {}
  for name, vals in rows.items():
    a = np.asarray(vals)
    mean, std = a.mean(0), a.std(0)
    print(f"{name:<30} " + " ".join(f"{m:>10.4f} ± {s:<7.4f}" for m, s in zip(mean, std)))
    out[name] = {"flips": mean[0], "flips_std": std[0], "flips_replay_on": mean[1],
                 "flips_replay_on_std": std[1], "dlogp_no_replay": mean[2],
                 "dlogp_replay": mean[3]}
  print(json.dumps(out))


if __name__ == "__main__":
  app.run(main)
