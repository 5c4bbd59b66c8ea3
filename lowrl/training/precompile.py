"""Compiling a run's later programs on a background thread while the main thread runs earlier ones.

A program whose argument shapes, dtypes and shardings are known before its first call (the RL
update `Trainer.step`, whose rollout is padded to [batch, prompt + max_new_tokens] and packed
inside the program, so no shape depends on the batch; the exact-mode re-score: `programs`) is
lowered and compiled ahead, `jitted.lower(*avals).compile()`, on a worker thread. JAX (0.10.2)
keeps what that builds in the caches an ordinary call looks in: the traced jaxpr (`pe.trace_to_jaxpr`, keyed by function and
argument avals), the lowering (`pjit._pjit_lower`, keyed by jaxpr and resolved shardings) and the
executable (held by that lowering). So the first `jitted(*args)` with arguments of those avals runs
the executable compiled on the thread, with nothing traced, lowered or compiled again: the same
executable an ordinary first call would compile, so the same bits.

The main thread must not call a program the worker is still compiling (it would compile it a
second time beside it): `wait(name, args)` blocks until the worker is done with it, then checks
that the call's avals are the precompiled ones. A failed background compile, or arguments that
differ, fall back to the ordinary call (it compiles the program itself, and a genuine error raises
there, on the main thread), each with one logged line. `close` (or leaving the `with` block)
waits for the compiles submitted: no thread outlives the run.
"""
from __future__ import annotations

import concurrent.futures
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax import monitoring

from lowrl.sampling import SampleOutput
from lowrl.sampling.act_scales import calibration_paths
from lowrl.sampling.rescore import scoring_program
from lowrl.training import optimizer
from lowrl.training.step import Rollout

# Seconds the main thread waited for a background compile (a jax.monitoring event, so
# experiments/bench_repeat_run counts it with the compile seconds spent on the main thread).
WAIT_EVENT = "/lowrl/precompile/wait_duration"


def avals(tree: Any, shardings: Any = None) -> Any:
  """`tree`'s leaves as ShapeDtypeStructs with their weak types and shardings (`shardings`: a
  sharding per leaf, or one for a subtree, instead of the leaves' own). An aval holds its
  sharding's mesh, and JAX's trace cache keys on avals: an argument on the run's mesh matches only
  a spec on it."""
  def spec(x, sharding):
    return jax.ShapeDtypeStruct(x.shape, x.dtype, weak_type=getattr(x, "weak_type", False),
                                sharding=sharding or getattr(x, "sharding", None))

  if shardings is None:
    return jax.tree.map(lambda x: spec(x, None), tree)
  return jax.tree.map(lambda s, sub: jax.tree.map(lambda x: spec(x, s), sub), shardings, tree,
                      is_leaf=lambda s: isinstance(s, jax.sharding.Sharding))


def programs(trainer: Any) -> list[tuple[str, Any, tuple]]:
  """(name, jitted program, argument avals) of the programs of `trainer`'s first RL step whose
  arguments are known from the config alone, in the order the step first calls them: the
  exact-mode sampler's re-score (`score`; also the trainer's pi_old) and the update (`step`).
  None of them where the shapes are not known up front (a LoRA run's adapters and packed base,
  an MoE model's routing record); no re-score where the sampler reads static activation scales
  (their calibrated tree) or is not in exact mode.

  The rollout is the sampler's [batch, prompt + max_new_tokens] output (packing happens inside
  the programs, so no shape depends on the batch). `Precompiler.wait` checks the update's avals
  against the real call's, and a program compiled for other avals is simply compiled again when
  called: a drift from `Trainer.rollout` costs a compile, never a wrong result.
  """
  setup = trainer.setup
  if setup.lora is not None or setup.model_cfg.is_moe:
    return []
  knobs, plan = setup.loop, trainer.plan
  params = jax.eval_shape(lambda p: optimizer.to_master(p, knobs.master_dtype),
                          trainer.param_shapes)
  b, p = knobs.batch_size, setup.task.max_prompt_len
  bl = (b, p + setup.sampling.max_new_tokens)
  key = jax.eval_shape(lambda: jax.random.key(0))

  def arr(shape, dtype):
    return jax.ShapeDtypeStruct(shape, dtype)

  out = []
  policy = setup.sampler_policy
  if knobs.sampler_exact and not calibration_paths(policy, setup.model_cfg):
    # rescore's arguments: (params, tokens, attention mask, quant key, act_amax None).
    args = avals((params, arr(bl, jnp.int32), arr(bl, jnp.float32), policy.quant_key(key)),
                 (plan.param_shardings(params), plan.batch, plan.batch, plan.replicated))
    configs = [None] + ([setup.sampling] if setup.sampling.modifies_distribution else [])
    for config in configs:
      program = scoring_program(setup.model_cfg, policy, config, plan=plan,
                                pack=setup.update_cfg.pack)
      out.append(("score" if config is None else "score_q", program, (*args, None)))
  sample = SampleOutput(tokens=arr(bl, jnp.int32), prompt_mask=arr(bl, jnp.float32),
                        completion_mask=arr(bl, jnp.float32), logprobs=arr(bl, jnp.float32),
                        model_logprobs=arr(bl, jnp.float32), prompt_lengths=arr((b,), jnp.int32),
                        completion_lengths=arr((b,), jnp.int32), prompt_width=p)
  rollout = Rollout(sample, arr((b,), jnp.float32), arr(bl, jnp.float32), arr(bl, jnp.float32))
  args = (params, jax.eval_shape(trainer.opt_init, params),
          params if knobs.keep_reference else None, rollout, key)
  out.append(("step", trainer.step,
              tuple(avals(a, s) for a, s in zip(args, trainer.step_shardings))))
  return out


def _typeof(tree: Any) -> tuple:
  """`tree`'s structure and the avals JAX traces its leaves with (shape, dtype, weak type,
  sharding with its mesh)."""
  leaves, treedef = jax.tree.flatten(tree)
  return treedef, [jax.typeof(x) for x in leaves]


class Precompiler:
  """Compiles jitted programs ahead on one worker thread; see the module docstring.

  Example:
    with Precompiler(log) as pre:
      pre.submit("step", trainer.step, *abstract_args)
      ...                                   # the main thread runs other programs meanwhile
      pre.wait("step", args)
      trainer.step(*args)                   # the precompiled executable
  """

  def __init__(self, log: Callable[[str], None] = print):
    self._log = log
    self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="lowrl-precompile")
    self._pending: dict[str, tuple[concurrent.futures.Future, Any]] = {}

  def submit(self, name: str, jitted: Any, *args: Any) -> None:
    """Lowers and compiles `jitted` for `args` (ShapeDtypeStructs or arrays: only their avals
    are read) on the worker thread, after what was submitted before."""
    if name in self._pending:
      raise ValueError(f"precompile: {name!r} was submitted already")
    spec = avals(args)
    self._pending[name] = (self._pool.submit(lambda: jitted.lower(*spec).compile()), spec)

  def wait(self, name: str, args: Any = None) -> bool:
    """Blocks until `name`'s background compile is done, before its first call with `args`.

    True: the call will run the precompiled executable. False (nothing submitted under `name`,
    the compile failed, or `args` have other avals than those compiled for; None: not checked)
    the call compiles as it would without this module; a failure or a mismatch is logged.
    """
    if name not in self._pending:
      return False
    future, spec = self._pending.pop(name)
    t0 = time.perf_counter()
    try:
      future.result()
    except Exception as e:  # noqa: BLE001 - reported, and the ordinary call compiles it anew
      self._log(f"[precompile] {name}: the background compile failed "
                f"({type(e).__name__}: {e}); compiling it on the main thread")
      return False
    finally:
      monitoring.record_event_duration_secs(WAIT_EVENT, time.perf_counter() - t0)
    if args is not None and _typeof(tuple(args)) != _typeof(spec):
      self._log(f"[precompile] {name}: the call's arguments differ from those it was "
                "compiled for; compiling it on the main thread")
      return False
    return True

  def close(self) -> None:
    """Waits for the compiles submitted (the run's one or two; XLA cannot stop one midway) and
    reports a failure no `wait` saw."""
    self._pool.shutdown(wait=True)
    for name, (future, _) in self._pending.items():
      if future.exception() is not None:
        self._log(f"[precompile] {name}: the background compile failed, unused "
                  f"({type(future.exception()).__name__}: {future.exception()})")
    self._pending.clear()

  def __enter__(self) -> Precompiler:
    return self

  def __exit__(self, *exc) -> None:
    self.close()
