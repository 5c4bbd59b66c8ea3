"""The Trainer: the jitted programs of one run (sampling, scoring, the RL step, evaluation,
probes) built from its `Setup`; the state lives in plain pytrees the loop passes in."""
from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from lowrl import distributed, precision
from lowrl.models import blocks, calibration, init, layout, lora
from lowrl.rl.mismatch import mismatch_metrics
from lowrl.sampling import SampleOutput, Sampler, adapter_sync, refit, rescore
from lowrl.sampling.act_scales import calibration_paths
from lowrl.tasks.batching import decode_batch, encode_prompts, encode_sft
from lowrl.training import (aqn, compute_cast, diagnostics, lora_update, optimizer, probes,
                            routing_replay)
from lowrl.training.evaluation import eval_metrics, solved_ci
from lowrl.training.kv_share import kv_share_metrics
from lowrl.training.loss_scaling import loss_scaled
from lowrl.training.rl_update import make_logprob_fn
from lowrl.training.setup import Setup
from lowrl.training.step import Rollout, make_step

Log = Callable[[str], None]
_PROBE_STREAM = 0x9B0BE  # fold_in of the step key for the probes: a stream no step uses
_LORA_STREAM = 0x10A  # fold_in of the run's seed key for the adapters' init


def _map_param_trees(state: dict[str, Any], f: Callable[[Any], Any]) -> dict[str, Any]:
  """`state` with `f` applied to each of its param trees: params, ref_params, every version."""
  out = dict(state, params=f(state["params"]))
  if "ref_params" in state:
    out["ref_params"] = f(state["ref_params"])
  if "versions" in state:
    out["versions"] = {v: f(p) for v, p in state["versions"].items()}
  return out


@jax.jit
def _chunked_mismatch_metrics(logp: list, logp_other: list, mask: list) -> dict[str, jax.Array]:
  """mismatch_metrics of the concatenated per-chunk arrays, as one program. Op by op, on arrays
  sharded over the mesh, this was where a test worker aborted natively twice (docs/integrity.md):
  one compiled program replaces a dozen eager multi-device ones."""
  return mismatch_metrics(jnp.concatenate(logp), jnp.concatenate(logp_other),
                          jnp.concatenate(mask))


class Trainer:
  """Holds the jitted functions of one run; the state lives in plain pytrees."""

  def __init__(self, setup: Setup, log: Log = print):
    self.setup = setup
    self.log = log
    knobs = setup.loop
    self.tx = setup.tx
    self._packed_base = setup.lora is not None and setup.lora.packed_base
    self.logprob_fn = loss_scaled(
        make_logprob_fn(setup.model_cfg, setup.trainer_policy, setup.sampling,
                        replay=knobs.routing_replay), knobs.loss_scale)
    # The pure RL step the simulator also runs (lowrl.training.step), unjitted.
    # Every step runs on the mesh with explicit shardings: sampler and update take the same
    # sharded params (no gather in between), batches are split over the batch axes.
    self.plan = plan = setup.plan
    # LoRA (setup.lora): the params carry adapters next to their kernels and the step trains
    # those alone (lowrl.training.lora_update); the optimizer state covers the adapters only.
    make = make_step if setup.lora is None else lora_update.make_lora_step
    self.step_fn = make(self.logprob_fn, self.tx, setup.update_cfg, setup.batch_cfg, plan)
    self.param_shapes = init.param_shapes(setup.model_cfg)
    if setup.lora is not None:
      self.param_shapes = lora.merge(self.param_shapes,
                                     lora.adapter_shapes(setup.lora, setup.model_cfg))
    p_sh = plan.param_shardings(self.param_shapes)
    if self._packed_base:  # packed kernels replicated (their shapes are no kernel's)
      p_sh = plan.shardings_like_params(jax.eval_shape(self._pack, self.param_shapes),
                                        self.param_shapes)
    self.opt_init = (  # unjitted: params -> optimizer state (shapes for a restore too)
        (lambda p: optimizer.init_opt_state(self.tx, p)) if setup.lora is None
        else (lambda p: lora_update.init_opt_state(self.tx, p)))
    init_opt = self.opt_init
    o_sh = plan.shardings_like_params(jax.eval_shape(init_opt, self.param_shapes),
                                      self.param_shapes)
    self.init_opt_state = jax.jit(init_opt, in_shardings=(p_sh,), out_shardings=o_sh)
    ref_sh = p_sh if knobs.keep_reference else plan.replicated
    batch, repl = plan.batch, plan.replicated
    self.step_shardings = (p_sh, o_sh, ref_sh, batch, repl)  # also lowrl.training.precompile's
    self.step = jax.jit(self.step_fn, donate_argnums=(0, 1), in_shardings=self.step_shardings,
                        out_shardings=(p_sh, o_sh, repl))
    # optimizer.compute_cast_rounding=stochastic: pi_old is scored on the compute copy of the
    # step's first update (the sampler keeps the nearest cast: lowrl.training.compute_cast).
    cast = setup.update_cfg.compute_cast
    self._cast = (jax.jit(lambda p, k: compute_cast.stochastic_cast(p, cast, k),
                          in_shardings=(p_sh, repl), out_shardings=p_sh) if cast else None)
    # Rollouts in the sampler's precision (exact mode: re-scored by the sampler's own policy).
    self.sampler = Sampler(setup.model_cfg, setup.sampler_policy, setup.sampling,
                           exact=knobs.sampler_exact, plan=plan,
                           record_routing=setup.model_cfg.is_moe,
                           decode_min_rows=knobs.sampler_decode_min_rows,
                           decode_buckets_per_halving=knobs.sampler_decode_buckets_per_halving,
                           pack=setup.update_cfg.pack)
    # Whether the exact-mode sampler's record can be the trainer's pi_old (sampler_scored_pi_old).
    self._exact_twin = (knobs.sampler_exact and setup.sampler_policy == setup.trainer_policy
                        and not setup.trainer_policy.act_paths(layout.matmuls(setup.model_cfg),
                                                               "tensor"))
    # Evaluation samples the trainer's policy at the rollout temperature and greedily, both in
    # one decode program (`greedy` is a runtime flag of the rollout's sampling config).
    self.eval_sampler = Sampler(setup.model_cfg, setup.trainer_policy, setup.sampling, plan=plan)
    self._calibrate = jax.jit(calibration.calibrate_act_amax,
                              static_argnames=("model_cfg", "policy", "paths"))
    self.calib_tokens, self.calib_mask = self._calibration_batch(repl)
    # The sampler's weights between syncs (packed, + static scales) and the refit check.
    # A LoRA run's sync moves only the adapters after the first (lowrl.sampling.adapter_sync).
    # With AQN it moves the noisy RMSNorm weights too (lowrl.training.aqn).
    refitter = (refit.Refitter if setup.lora is None else functools.partial(
        adapter_sync.AdapterRefitter, moves=aqn.NORMS if setup.aqn is not None else None))
    self.refit = refitter(setup.model_cfg, setup.sampler_policy,
                                lambda p: self.act_amax(p, setup.sampler_policy),
                                check_every=knobs.refit_check_every, log=log)
    # Gradient bias vs FP32 and update erasure (diagnostics.every): programs of their own (the
    # FP32 gradient's and the erasure's are the same for every recipe: the compile cache shares
    # them between runs).
    self._probe_fns = None
    if knobs.diagnostics_every:
      fp32 = precision.PrecisionPolicy.unquantized(layout.matmuls(setup.model_cfg), "float32",
                                                   name="fp32")
      grad_in = (p_sh, ref_sh, batch, repl)
      self._probe_fns = (
          jax.jit(probes.make_grad_fn(self.logprob_fn, setup.update_cfg, setup.batch_cfg),
                  in_shardings=grad_in, out_shardings=p_sh),
          jax.jit(probes.make_grad_fn(make_logprob_fn(setup.model_cfg, fp32, setup.sampling,
                                                      replay=knobs.routing_replay),
                                      dataclasses.replace(setup.update_cfg, compute_cast=()),
                                      setup.batch_cfg, param_dtype="float32"),
                  in_shardings=grad_in, out_shardings=p_sh),
          jax.jit(probes.grad_agreement, out_shardings=repl),
          jax.jit(probes.make_erasure_fn(self.tx, knobs.master_rounding),
                  in_shardings=(p_sh, p_sh, o_sh, repl), out_shardings=repl))
    # A Precompiler compiling the update and re-score ahead (lowrl.training.precompile; the loop's).
    self.precompiler = None
    self.weight_errors = jax.jit(
        lambda p: diagnostics.weight_quant_errors(p, setup.model_cfg, setup.trainer_policy),
        in_shardings=(p_sh,), out_shardings=repl)
    if self._packed_base:  # the master weights are gone (and the frozen base's error is fixed)
      self.weight_errors = lambda p: {}

  def with_adapters(self, base: Any) -> Any:
    """The run's initial params from its base: + fresh adapters (B = 0) in a LoRA run, drawn
    from the run's seed; the base itself otherwise."""
    lc = self.setup.lora
    if lc is None:
      return base
    key = jax.random.fold_in(jax.random.key(self.setup.loop.seed), _LORA_STREAM)
    return self._pack(lora.merge(base, lora.init_adapters(lc, self.setup.model_cfg, key)))

  def _pack(self, params: Any) -> Any:
    """`params` with the base packed when the run holds it packed (lora.packed_base)."""
    if not self._packed_base:
      return params
    return lora_update.pack_base(params, self.setup.model_cfg, self.setup.trainer_policy)

  def checkpointed(self, state: dict[str, Any]) -> dict[str, Any]:
    """The tree a checkpoint stores of `state` (lowrl.training.state.state_tree): in a LoRA run
    its param trees (params, ref_params, versions) as their adapters alone (the base is frozen:
    `restored` puts the run's base back); the state itself otherwise. Works on shape trees."""
    if self.setup.lora is None:
      return state
    return _map_param_trees(state, lambda p: lora.split(p)[1])

  def restored(self, state: dict[str, Any], base: Any) -> dict[str, Any]:
    """Inverse of `checkpointed`: `base` (the run's base params, frozen) merged back into each
    param tree of a restored checkpoint. The trees share `base`'s buffers: callers keep copies
    where the update's donation would reach them (lowrl.training.storage.keep)."""
    if self.setup.lora is None:
      return state
    base = self._pack(base)
    return _map_param_trees(state, lambda p: lora.merge(base, p))

  def state_shardings(self, state: Any) -> Any:
    """Shardings of a state tree: parameter-shaped leaves as the params, the rest replicated."""
    return self.plan.shardings_like_params(state, self.param_shapes)

  def place(self, state: Any) -> Any:
    """`state` on the mesh (every process must call this alike)."""
    return self.plan.put(state, self.state_shardings(state))

  def score(self, params, policy: precision.PrecisionPolicy, out: SampleOutput,
            key: jax.Array, act_amax: blocks.ActAmax | None = None) -> jax.Array:
    """Logprobs of the sampled tokens under (params, policy): the exact-mode scoring program.

    The trainer's pi_old, the drift parts and the exact-mode sampler all go through this one
    jitted program (packed rows with rl.pack_tokens, in both), so equal inputs give
    bit-identical logprobs. `act_amax` None: tensor-scaled activations take the batch's amax (the
    trainer's forward); static scales: the distribution a sampler with those scales draws from
    (`policy_kl`).
    """
    return rescore(out, params, model_cfg=self.setup.model_cfg, policy=policy,
                   config=self.setup.sampling, quant_key=policy.quant_key(key),
                   plan=self.plan, act_amax=act_amax, pack=self.setup.update_cfg.pack
                   ).logprobs  # log q: the sampled distribution

  def act_amax(self, params, policy: precision.PrecisionPolicy) -> dict[str, jax.Array] | None:
    """Static activation scales for sampling `params` under `policy` (None if it needs none).

    A recipe that scales activations per tensor samples with static amaxes, as inference engines
    do: calibrated (max |input| per matmul, trainer's precision) on a fixed batch of train prompts
    + reference answers from the weights being sampled, i.e. recalibrated at every weight sync.
    """
    paths = calibration_paths(policy, self.setup.model_cfg)  # + a quantized KV cache's K/V
    if not paths:
      return None
    tp = self.setup.trainer_policy
    return self._calibrate(params, self.calib_tokens, model_cfg=self.setup.model_cfg, policy=tp,
                           paths=paths, mask_BT=self.calib_mask,
                           quant_key=tp.quant_key(jax.random.key(self.setup.loop.seed)))

  def _calibration_batch(self, sharding_) -> tuple[jax.Array, jax.Array]:
    """64 fixed train examples, prompt + answer + eos (right-padded), and their token mask."""
    task = self.setup.task
    examples = task.sample(np.random.default_rng([self.setup.loop.seed, 5]), 64, "train")
    tokens, target_mask = encode_sft(task.tokenizer, [e.prompt for e in examples],
                                     [task.target_text(e) for e in examples],
                                     task.max_prompt_len + task.max_answer_len)
    ends = target_mask.shape[1] - np.argmax(target_mask[:, ::-1] > 0, axis=1)
    mask = np.arange(tokens.shape[1])[None, :] < ends[:, None]
    return self.plan.put((jnp.asarray(tokens), jnp.asarray(mask)), sharding_)

  # -- data -------------------------------------------------------------------------------------

  def prompts(self, step: int):
    """The step's prompts (data position = step), each repeated group_size times."""
    knobs = self.setup.loop
    rng = np.random.default_rng([knobs.seed, 2, step])
    examples = self.setup.task.sample(rng, knobs.num_prompts, "train")
    examples = [e for e in examples for _ in range(knobs.group_size)]
    tokens, mask = self._encode(examples)
    return examples, jnp.asarray(tokens), jnp.asarray(mask)

  def _encode(self, examples) -> tuple[np.ndarray, np.ndarray]:
    """The examples' prompts left-padded to the task's prompt length, and their token mask."""
    tokens, lens = encode_prompts(self.setup.task.tokenizer, [e.prompt for e in examples],
                                  self.setup.task.max_prompt_len)
    return tokens, np.arange(tokens.shape[1])[None, :] < lens[:, None]

  def rewards(self, out: SampleOutput, examples) -> tuple[np.ndarray, list[str]]:
    """The task verifier's float32 [B] rewards of the completions (host), and their text."""
    tokens = distributed.to_host(out.tokens)
    completions = decode_batch(self.setup.task.tokenizer, tokens,
                               np.full((tokens.shape[0],), out.prompt_width))
    return self.setup.task.rewards(completions, examples).astype(np.float32), completions

  # -- evaluation -------------------------------------------------------------------------------

  def evaluate(self, params, key: jax.Array) -> dict[str, float]:
    """Held-out evaluation on a fixed set of eval-split prompts (`evaluation.eval_metrics`).

    pass_at_1: the success rate of one sample at the rollout temperature (the unbiased estimate
    from `eval_samples` samples per prompt, as RL papers report it); greedy: temperature-0
    accuracy; each with its 95% interval over the prompts (`pass_at_1_ci_low`, ..._high,
    `evaluation.solved_ci`). The samples' mean reward is not reported: with the tasks' 0/1
    rewards it is pass_at_1 again.
    """
    examples, tokens, mask = self._eval_prompts()
    k_greedy, k_sample = jax.random.split(key)
    qk = self.setup.trainer_policy.quant_key(key)
    act_amax = self.act_amax(params, self.setup.trainer_policy)
    weights = self._eval_weights(params)

    def rewards(chunks):
      return np.concatenate([self.rewards(out, chunk)[0] for out, chunk in chunks])

    greedy = rewards(self._decode_chunks(weights, examples, tokens, mask, k_greedy, quant_key=qk,
                                         act_amax=act_amax, greedy=True))
    sampled = rewards(self._sample_chunks(weights, k_sample, quant_key=qk, act_amax=act_amax))
    m = eval_metrics(greedy, sampled)
    out = {}
    # "pass_at_1", not "pass@1": TensorBoard tag names cannot hold "@".
    for name, rewards_PN in (("pass_at_1", sampled.reshape(len(examples), -1)),
                             ("greedy", greedy.reshape(len(examples), 1))):
      out[name] = float(m[name])
      out[f"{name}_ci_low"], out[f"{name}_ci_high"] = solved_ci(rewards_PN)
    return out

  def _eval_samples(self, params, key: jax.Array, *, quant_key: jax.Array | None,
                    act_amax: blocks.ActAmax | None) -> list[tuple[SampleOutput, list]]:
    """`eval_samples` completions of every held-out prompt at the rollout temperature, from the
    trainer's policy, as (SampleOutput, examples) chunks of a rollout's rows (the last one may be
    smaller), chunk i sampled with fold_in(key, i): `_sample_chunks` of `_eval_weights(params)`.
    """
    return self._sample_chunks(self._eval_weights(params), key, quant_key=quant_key,
                               act_amax=act_amax)

  def _sample_chunks(self, weights, key: jax.Array, *, quant_key: jax.Array | None,
                     act_amax: blocks.ActAmax | None) -> list[tuple[SampleOutput, list]]:
    """`_eval_samples` from weights already as `_eval_weights` gives them.

    A chunk the size of a rollout needs no more device memory than a rollout.
    """
    examples, tokens, mask = self._eval_prompts()
    n = self.setup.loop.eval_samples
    examples = [e for e in examples for _ in range(n)]
    return self._decode_chunks(weights, examples, np.repeat(tokens, n, 0),
                               np.repeat(mask, n, 0), key, quant_key=quant_key,
                               act_amax=act_amax, greedy=False)

  def _decode_chunks(self, weights, examples, tokens, mask, key: jax.Array, *,
                     quant_key: jax.Array | None, act_amax: blocks.ActAmax | None,
                     greedy: bool) -> list[tuple[SampleOutput, list]]:
    """(SampleOutput, examples) of the prompts `tokens` in chunks of a rollout's rows (the last
    one may be smaller), chunk i with fold_in(key, i), greedy or at the rollout temperature.

    Every full chunk, greedy or sampled, runs one compiled decode program (`generate`'s runtime
    `greedy`; row by row prefill, one bucket: an eval chunk holds `eval_samples` rows per prompt,
    not the rollout's groups, so it is not the rollout's program).
    """
    rows = self.setup.batch_size
    return [(self.eval_sampler(weights, jnp.asarray(tokens[i:i + rows]),
                               jnp.asarray(mask[i:i + rows]), jax.random.fold_in(key, i // rows),
                               quant_key=quant_key, act_amax=act_amax, greedy=greedy),
             examples[i:i + rows])
            for i in range(0, len(examples), rows)]

  def _eval_weights(self, params):
    """`params` as the rollout's sampler holds them when it shares the trainer's recipe (its
    packed kernels: `Refitter.pack`, whose program the syncs have compiled), so evaluation
    decodes the sampler's prequantized policy; else `params` themselves.

    Exact either way: the packed kernels dequantize to the fake-quantized weights the decode
    program would compute from `params` (lowrl.sampling.weights), bit for bit.
    """
    if self.setup.sampler_policy != self.setup.trainer_policy:
      return params
    return self.refit.pack(params)

  def _eval_prompts(self) -> tuple[list, np.ndarray, np.ndarray]:
    """The fixed held-out prompts (eval split, `eval_num_prompts`), left-padded, and their mask."""
    knobs = self.setup.loop
    rng = np.random.default_rng([knobs.seed, 3])
    examples = self.setup.task.sample(rng, knobs.eval_num_prompts, "eval")
    return (examples, *self._encode(examples))

  def policy_kl(self, params, other_params, other_policy: precision.PrecisionPolicy,
                key: jax.Array) -> dict[str, float]:
    """KL(pi || pi_other) per completion token on the held-out prompts.

    pi = `params` under this run's trainer policy, pi_other = `other_params` under
    `other_policy` (e.g. a BF16 twin run's final params); each the distribution its sampler draws
    from at the rollout temperature: a policy with tensor-scaled activations (naive NVFP4) with
    its static calibrated scales (`act_amax`), as `evaluate` samples it. `eval_samples`
    completions per held-out prompt are sampled from pi and both policies score them with the
    exact-mode scoring program, pi with the scales it sampled with (with the batch's amax, the
    trainer's forward, the samples would not come from the scored distribution and k3 would not
    estimate the KL); returns {"kl": k1 mean, "kl_k3": k3 mean, "abs_dlogp_mean": ...}
    (`mismatch_metrics` of logp_pi - logp_other: unbiased estimates of KL(pi || pi_other) on
    pi's samples).
    """
    tp = self.setup.trainer_policy
    model_cfg = self.setup.model_cfg
    if other_policy != tp and calibration_paths(other_policy, model_cfg):
      raise ValueError(f"policy_kl: other_policy {other_policy.name!r} reads static activation "
                       "scales calibrated in the trainer's precision only; compare with a policy "
                       "without tensor-scaled activations (e.g. bf16) or the trainer's own")
    act_amax = self.act_amax(params, tp)
    other_amax = self.act_amax(other_params, other_policy)
    logp, logp_other, mask = [], [], []
    for out, _ in self._eval_samples(params, key, quant_key=tp.quant_key(key),
                                     act_amax=act_amax):
      logp.append(self.score(params, tp, out, key, act_amax=act_amax))
      logp_other.append(self.score(other_params, other_policy, out, key, act_amax=other_amax))
      mask.append(out.completion_mask)
    m = _chunked_mismatch_metrics(logp, logp_other, mask)
    return {"kl": float(m["mismatch_kl"]), "kl_k3": float(m["mismatch_kl_k3"]),
            "abs_dlogp_mean": float(m["abs_dlogp_mean"])}

  # -- one step ---------------------------------------------------------------------------------

  def rollout(self, sampler_params, params, step: int, key: jax.Array,
              stale: bool, sampler_version: int | None = None,
              cast_key: jax.Array | None = None) -> tuple[Rollout, dict[str, Any]]:
    """Samples the step's batch with `sampler_params` (in the sampler's precision) and scores it.

    The trainer scores the sampled tokens with the current `params` in the trainer's precision
    (pi_old) and, when the sampler's version is `stale`, with the sampler's weights in the
    trainer's precision, for the drift decomposition. The sampler generates from the
    `RolloutWeights` of `sampler_version` (`self.refit`: re-quantized when the version changes,
    i.e. at each weight sync; None = every call). Returns (the step's Rollout, host info:
    rewards, completions, examples, refit metrics).
    """
    examples, tokens_BP, mask_BP = self.prompts(step)
    k_sample, k_quant = jax.random.split(key)
    # Exact mode re-scores in the sampler's precision with the same key it sampled with.
    sampler_qk = self.setup.sampler_policy.quant_key(k_quant)
    held, refit_metrics = self.refit(sampler_params, sampler_version)
    if self.precompiler is not None:  # the first rollout waits for its re-score compiled ahead
      self.precompiler.wait("score")
      self.precompiler.wait("score_q")
    act_amax = held.act_amax  # + a quantized KV cache's K/V amaxes
    out = self.sampler(held.weights, tokens_BP, mask_BP, k_sample, quant_key=sampler_qk,
                       trainer_params=sampler_params, trainer_quant_key=sampler_qk,
                       act_amax=act_amax, group_size=self.setup.loop.group_size)
    routing_metrics = {}
    scored_sampler_params = sampler_params  # the weights the trainer's scores run on
    if self._cast is not None and cast_key is not None:
      params = self._cast(params, cast_key)
      scored_sampler_params = self._cast(sampler_params, cast_key) if stale else params
    if self.setup.model_cfg.is_moe:  # routing flips; rl.routing_replay (routing_replay.py)
      logp_now_BT, logp_stale_BT, routing_metrics = routing_replay.trainer_scores(
          self, out, scored_sampler_params, params, k_quant, stale)
    else:
      logp_now_BT = (out.logprobs
                     if self.sampler_scored_pi_old(scored_sampler_params, params, stale)
                     else self.score(params, self.setup.trainer_policy, out, k_quant))
      logp_stale_BT = (self.score(scored_sampler_params, self.setup.trainer_policy, out, k_quant)
                       if stale else logp_now_BT)
    rewards, completions = self.rewards(out, examples)
    rollout = self.plan.put(Rollout(out, jnp.asarray(rewards), logp_now_BT, logp_stale_BT),
                            self.plan.batch)
    return rollout, {"rewards": rewards, "completions": completions, "examples": examples,
                     "refit": refit_metrics, "routing": routing_metrics,
                     "kv": kv_share_metrics(  # {} without a quantized KV cache
                         out, sampler_params, model_cfg=self.setup.model_cfg,
                         policy=self.setup.sampler_policy, config=self.setup.sampling,
                         quant_key=sampler_qk, plan=self.plan, act_amax=act_amax,
                         pack=self.setup.update_cfg.pack)}

  def sampler_scored_pi_old(self, sampler_params, params, stale: bool) -> bool:
    """Whether the sampler's recorded logprobs are provably the trainer's pi_old, so `rollout`
    skips the second scoring pass.

    Exact mode records `rescore(out, sampler_params, policy=sampler policy, quant_key=k,
    act_amax=static scales)`; pi_old is `rescore(out, params, policy=trainer policy,
    quant_key=k', act_amax=None)`. With the same policy (then k' = k, and the same cached jitted
    program), no tensor-scaled activations (so both act_amax are None) and `sampler_params`
    the very buffers of `params` (not stale, no copy: lag 0, sync every step), both calls run one
    program on identical inputs, which is bit-identical; the mismatch metrics are then exactly 0
    either way. Never with a stochastic compute cast: pi_old is then the trainer's score of its
    compute copy (`compute_cast`), which the sampler (the nearest cast) does not sample from.
    """
    if not self._exact_twin or stale or self._cast is not None:
      return False
    ours, theirs = jax.tree.leaves(sampler_params), jax.tree.leaves(params)
    return len(ours) == len(theirs) and all(a is b for a, b in zip(ours, theirs))

  def probe(self, params, opt_state, ref_params, rollout: Rollout, key: jax.Array
            ) -> dict[str, jax.Array]:
    """`lowrl.training.probes` on the step's rollout, before its update: the trainer's gradient
    vs the FP32 one (`grad_bias/*`) and the erasure of one optimizer step on the trainer's
    gradient (`update_erasure`). Needs diagnostics.every > 0."""
    grad_q, grad_32, agreement, erasure = self._probe_fns
    k_grad, k_opt = jax.random.split(key)
    g_q = grad_q(params, ref_params, rollout, k_grad)
    metrics = agreement(g_q, grad_32(params, ref_params, rollout, k_grad))
    return {**metrics, "update_erasure": erasure(params, g_q, opt_state, k_opt)}

  def rl_step(self, sampler_params, params, opt_state, ref_params, step: int, key: jax.Array,
              stale: bool, probe: bool = False, sampler_version: int | None = None
              ) -> tuple[Any, Any, dict[str, jax.Array], dict[str, Any]]:
    """One RL step: rollout, then the jitted step (donates `params` and `opt_state`).

    `key` is the step's key (fold_in(run key, step)). `probe`: also run the gradient-bias /
    update-erasure probe (`lowrl.training.probes`) on the rollout, before the step, with a key
    of its own (the step's keys and numbers are unchanged). Returns (params, opt_state, metrics,
    host info of the rollout).
    """
    k_roll, k_upd = jax.random.split(key)
    cast_key = compute_cast.update_key(k_upd, 0) if self._cast is not None else None
    aqn_metrics, clean, sigma = {}, params, 0.0
    if self.setup.aqn is not None:  # QeRL's noise: this step's sampler and update see it
      sigma = aqn.sigma(self.setup.aqn, step, self.setup.loop.steps)
      noisy = lambda p: aqn.perturb(p, sigma, self.setup.loop.seed, step)  # noqa: E731
      sampler_params, params, aqn_metrics = noisy(sampler_params), noisy(params), {
          "aqn/sigma": jnp.float32(sigma)}
    rollout, info = self.rollout(sampler_params, params, step, k_roll, stale=stale,
                                 sampler_version=sampler_version, cast_key=cast_key)
    probe_metrics = {}
    if probe and self._probe_fns is not None:
      probe_metrics = self.probe(params, opt_state, ref_params, rollout,
                                 jax.random.fold_in(key, _PROBE_STREAM))
    args = (params, opt_state, ref_params, rollout, k_upd)
    if self.precompiler is not None:  # the first step waits for the update compiled ahead
      self.precompiler.wait("step", args)
    params, opt_state, metrics = self.step(*args)
    if sigma:  # the state keeps the clean base's norms
      params = aqn.restore(params, clean)
    return params, opt_state, {**metrics, **probe_metrics, **info["kv"], **info["refit"],
                               **info["routing"], **aqn_metrics}, info
