"""Supervised "mid-training": turn a random model into a base with a modest pass rate.

RL only works from a base whose pass@k is not zero (docs/reference.md §6), so every RL run starts
from a base trained with next-token cross-entropy on the task's reference targets. The base is
precision-agnostic (FP32 policy), identified by a fingerprint of everything that determines it,
and reused by every run (and every recipe) that asks for the same base (`base_store`).
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax

from lowrl.models import init, layout, logprobs
from lowrl.models.config import ModelConfig
from lowrl.precision import PrecisionPolicy
from lowrl.rl.masked import masked_mean
from lowrl.tasks.base import Task
from lowrl.tasks.batching import encode_sft
from lowrl.training import run_config, run_logs


@dataclasses.dataclass(frozen=True)
class SFTConfig:
  """The base's SFT settings (lowrl.training.schema.SFT has their meanings)."""

  steps: int
  batch_size: int
  lr: float
  warmup_steps: int


def sft_loss(params, tokens_BT, loss_mask_BT, model_cfg: ModelConfig,
             policy: PrecisionPolicy) -> jax.Array:
  """Mean next-token NLL over the target tokens (FP32).

  Rows are right-padded and attention is causal, so trailing padding never reaches a target token:
  no attention mask is needed.
  """
  logp_BT = logprobs.token_logprobs(params, tokens_BT, model_cfg, policy)
  return -masked_mean(logp_BT, loss_mask_BT)


def sft_policy(model_cfg: ModelConfig) -> PrecisionPolicy:
  """The base's precision: unquantized FP32 (the base is precision-agnostic)."""
  return PrecisionPolicy.unquantized(layout.matmuls(model_cfg), "float32", name="sft_fp32")


def make_sft_step(model_cfg: ModelConfig, tx: optax.GradientTransformation
                  ) -> Callable[..., tuple[Any, Any, jax.Array]]:
  """`step(params, opt_state, tokens_BT, loss_mask_BT) -> (params, opt_state, loss)`: one
  supervised step (`sft_loss` in FP32, then `tx`); pure and jittable.

  Shared by the loop's base (`train_base`, jitted per step) and the simulator's warm start
  (inside a `lax.scan`); each passes its own optimizer.
  """
  policy = sft_policy(model_cfg)

  def step(params, opt_state, tokens_BT, loss_mask_BT):
    loss, grads = jax.value_and_grad(sft_loss)(params, tokens_BT, loss_mask_BT, model_cfg, policy)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  return step


def fingerprint(task_cfg, model_cfg: ModelConfig, sft_cfg, seed: int) -> str:
  """Short hash of everything that determines the base."""
  sft = dict(sft_cfg.to_dict() if hasattr(sft_cfg, "to_dict") else sft_cfg)
  sft.pop("base_dir", None)  # where the base is stored does not change it
  sft.pop("seed", None)  # the loop's sft.seed: resolved into `seed`
  sft.pop("outlier_channels", None)  # planted on loading: the stored base has none
  sft.pop("outlier_gain", None)
  return run_config.digest({"task": task_cfg.to_dict() if hasattr(task_cfg, "to_dict") else task_cfg,
                            "model": repr(model_cfg), "sft": sft, "seed": seed}, 12)


def train_base(task: Task, model_cfg: ModelConfig, sft_cfg: SFTConfig | ml_collections.ConfigDict,
               seed: int, log: Callable[[str], None] = print,
               on_loss: Callable[[int, float], None] | None = None) -> Any:
  """Trains the base from scratch; deterministic in `seed`. `sft_cfg`: an SFTConfig or a
  validated sft section. `on_loss(step, loss)` is called at each logged step (e.g. to write it
  to TensorBoard)."""
  params = init.init_params(model_cfg, jax.random.key(seed))
  tx = optax.chain(
      optax.clip_by_global_norm(1.0),
      optax.adamw(optax.warmup_cosine_decay_schedule(0.0, sft_cfg.lr, sft_cfg.warmup_steps,
                                                     max(sft_cfg.steps, sft_cfg.warmup_steps + 1),
                                                     end_value=sft_cfg.lr * 0.1),
                  b1=0.9, b2=0.99, weight_decay=0.0))
  opt_state = tx.init(params)
  max_len = task.max_prompt_len + task.max_answer_len

  step = jax.jit(make_sft_step(model_cfg, tx), donate_argnums=(0, 1))
  rng = np.random.default_rng([seed, 1])
  eta = run_logs.Eta(sft_cfg.steps)  # from steady-state steps: step 1 compiles
  for i in range(sft_cfg.steps):
    examples = task.sample(rng, sft_cfg.batch_size, "train")
    tokens, mask = encode_sft(task.tokenizer, [e.prompt for e in examples],
                              [task.target_text(e) for e in examples], max_len)
    params, opt_state, loss = step(params, opt_state, jnp.asarray(tokens), jnp.asarray(mask))
    if (i + 1) % max(1, sft_cfg.steps // 10) == 0 or i == 0:
      log(f"[sft] step {i + 1}/{sft_cfg.steps} loss {float(loss):.4f} {eta.update(i + 1)}")
      if on_loss is not None:
        on_loss(i + 1, float(loss))
  return params
