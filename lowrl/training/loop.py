"""The RL training loop: mid-trained base (or a Hugging Face checkpoint) -> GRPO-family updates
under a precision recipe.

Everything static is built and validated by `lowrl.training.setup.build` before anything is
compiled; the programs are the `Trainer`'s (lowrl.training.trainer), the checkpointed tree is
lowrl.training.state's, what is logged lowrl.training.reporting's. This module runs (or resumes)
a run in its workdir and holds the step loop. Each step:
  1. the sampler generates a group of completions per prompt with the policy *version* and
     precision the asynchronous schedule says (version = current params when synchronous);
  2. the host decodes completions and scores them with the task's verifier;
  3. the trainer scores the sampled tokens (pi_old; and with the sampler's weights when they are
     stale) with the sampler's jitted exact-mode scoring program (`lowrl.sampling.rescore`),
     unless the exact-mode sampler already ran that program on the same inputs
     (`Trainer.sampler_scored_pi_old`);
  4. the jitted RL step (`lowrl.training.step`, shared with the simulator) builds the batch
     (overlong penalty, group advantages, dynamic sampling), the drift decomposition, and runs
     the pure update: mismatch correction and mu optimizer passes against that pi_old;
  5. metrics (reward, mismatch, drift decomposition, entropy, clip fraction, gradient norm,
     weight quantization error, sample texts) go to TensorBoard and `metrics.jsonl`;
  6. an orbax checkpoint every `checkpoint_every` steps (params, optimizer state, reference
     params, parameter versions the schedule still needs, RNG key, step, data position).
Prompts of step t are drawn from a generator seeded by (seed, t), so the data position is the
step and a resumed run sees exactly the prompts an uninterrupted one would.
"""
from __future__ import annotations

import contextlib
import json
import os
import time
from typing import Any

import jax
import ml_collections

from lowrl import distributed
from lowrl.metrics import layout as tb_layout
from lowrl.metrics.writer import create_writer
from lowrl.training import (base_store, code_churn, disk, pace, precompile, preemption,
                            run_config, run_logs, storage, zero_reward)
from lowrl.training.checkpointing import Checkpointer, read_meta
from lowrl.training.reporting import log_order, log_setup, log_step
from lowrl.training.schedule import VersionBuffer
from lowrl.training.setup import Setup, build
from lowrl.training.state import CHECKPOINTS, initial_state, state_tree
from lowrl.training.trainer import Log, Trainer
from lowrl.training.workdir_lock import WorkdirLock


class NonFiniteError(RuntimeError):
  """Training produced non-finite updates for `max_skipped_steps` steps in a row."""


@run_logs.run_clock  # one clock for the run's elapsed times
def run(cfg: ml_collections.ConfigDict, workdir: str, log: Log = print, *,
        allow_config_change: bool = False, reevaluate: bool = False) -> dict[str, Any]:
  """Runs (or resumes) the whole pipeline in `workdir`; returns the summary.

  A workdir holding a finished run returns its summary without running anything (`reevaluate`:
  evaluate the final parameters again and rewrite summary.json). Resuming under a changed config
  raises run_config.ConfigChangedError unless `allow_config_change`. `cfg` itself is read by
  `build` and, to check or write the workdir's config.json, by `_open_workdir`; nothing else.
  """
  try:
    setup = build(cfg)  # every config error surfaces here, before any compile
  except ValueError as e:
    raise run_config.ConfigError(str(e)) from e
  primary = distributed.is_primary()  # only process 0 logs and writes files (orbax: all save)
  if not primary:
    log = lambda _: None  # noqa: E731
  if not reevaluate and not disk.writable(workdir):  # a finished run is still shown
    summary = run_logs.finished_summary(workdir, setup.loop.steps)
    if summary is not None:
      return _show_finished(summary, workdir, setup, log)
  knobs = setup.loop
  disk.check_workdir(workdir, disk.needed_bytes(
      setup.model_cfg.num_params(), os.path.join(workdir, CHECKPOINTS),
      master_dtype=knobs.master_dtype,
      reference_storage=knobs.ref_storage if knobs.keep_reference else None,
      version_storage=knobs.version_storage,
      versions=setup.schedule.max_versions if setup.schedule.stale else 0))
  with (WorkdirLock(workdir, log) if primary else contextlib.nullcontext()), \
      preemption.stop_on_signals() as stop, disk.one_line_when_full(), \
      precompile.Precompiler(log) as pre:  # leaving it waits for a compile still running
    try:
      ckpt, resuming = _open_workdir(cfg, setup, workdir, log, allow_config_change)
      return _run_in_workdir(setup, ckpt, resuming, workdir, log, stop, reevaluate=reevaluate,
                             pre=pre)
    except Exception as e:
      if not disk.is_disk_full(e, workdir):
        raise
      raise disk.DiskFullError(disk.full_message(workdir, os.path.join(workdir, CHECKPOINTS))
                               ) from None


def load_base(cfg: ml_collections.ConfigDict, workdir: str, log: Log = print) -> Any:
  """The base params a run of `cfg` in `workdir` starts from (trained and saved if missing)."""
  setup = build(cfg)
  return base_store.load_base(setup.base, setup.task, setup.model_cfg, setup.plan, workdir, log)


def _show_finished(summary: dict[str, Any], workdir: str, setup: Setup, log: Log
                   ) -> dict[str, Any]:
  log(f"[done] {workdir} holds a finished run ({setup.loop.steps} steps); nothing to do "
      "(--reevaluate evaluates it again).")
  log(json.dumps(summary, indent=2))
  return summary


def _open_workdir(cfg: ml_collections.ConfigDict, setup: Setup, workdir: str, log: Log,
                  allow_config_change: bool) -> tuple[Checkpointer, bool]:
  """The run's checkpointer and whether it resumes; checks (or writes) the workdir's copy of the
  config `cfg` (run_config.check_or_write).

  An earlier attempt's logs without a checkpoint to resume from are moved aside. Once every check
  passed (a refusal touches nothing), a killed run's unfinished saves and temporary files go.
  """
  primary = distributed.is_primary()
  os.makedirs(workdir, exist_ok=True)
  # Asynchronous: a save's files are written while the next steps train.
  ckpt = Checkpointer(os.path.join(workdir, CHECKPOINTS), every=setup.loop.checkpoint_every,
                      async_save=True, keep=setup.loop.keep_steps)
  try:
    steps = ckpt.all_steps()
    resuming = bool(steps)
    if resuming and primary:  # damaged bookkeeping: one line, before anything is compiled
      run_logs.check_resumable(workdir)
    if not resuming and primary and run_logs.has_logs(workdir):
      dest = run_logs.move_aside(workdir)
      log(f"[warn] {workdir} has logs of an earlier attempt but no finished checkpoint: they "
          f"were moved to {dest}; starting from step 0.")
    newest = read_meta(ckpt.step_dir(steps[-1])) if steps else None
    changes = run_config.check_or_write(workdir, cfg, resuming=resuming,
                                        allow_change=allow_config_change, write=primary,
                                        checkpoint_fingerprint=(newest or {}).get(
                                            "config_fingerprint"))
  except BaseException:
    ckpt.close()  # a refusal leaves no orbax thread behind (nor touches the unfinished saves)
    raise
  # The lock is held: nothing among these is a live run's write in progress.
  if ckpt.remove_unfinished():
    log(f"[checkpoint] removed unfinished saves {ckpt.unfinished} (never restorable)")
  if primary and (temps := run_logs.remove_temp_files(workdir)):
    log(f"[workdir] removed temporary files of an interrupted write: {', '.join(temps)}")
  log("[config]\n" + setup.record.text)
  for c in changes:
    log(f"[config] changed since the last start (--allow_config_change): {c}")
  return ckpt, resuming


def _run_in_workdir(setup: Setup, ckpt: Checkpointer, resuming: bool, workdir: str, log: Log,
                    stop: preemption.StopFlag, *, reevaluate: bool,
                    pre: precompile.Precompiler | None = None) -> dict[str, Any]:
  """`run` once the workdir is checked, locked and opened; `pre` (config precompile) compiles the
  first step's update and re-score on a background thread while the base trains."""
  primary = distributed.is_primary()
  summary = run_logs.finished_summary(workdir, setup.loop.steps)
  if summary is not None and not reevaluate:
    return _show_finished(summary, workdir, setup, log)
  log_setup(setup, workdir, log)

  t0 = run_logs.run_started() or time.time()
  tb_dir = os.path.join(workdir, run_logs.TB_DIR)
  # The SFT loss (when this run trains the base) goes to a TensorBoard run of its own, `tb/sft`:
  # its steps are SFT steps, and a resume's purge of RL steps must not touch them.
  trainer = Trainer(setup, log)  # before the base: its update compiles while the base trains
  if pre is not None and setup.loop.precompile and not reevaluate:
    for name, program, args in precompile.programs(trainer):
      pre.submit(name, program, *args)
    trainer.precompiler = pre
  with create_writer(os.path.join(tb_dir, tb_layout.SFT_RUN),
                     enabled=primary and not resuming) as sft_tb:
    base = base_store.load_base(setup.base, setup.task, setup.model_cfg, setup.plan, workdir,
                                log, on_sft_loss=lambda i, v: sft_tb.scalars(i, {"sft/loss": v}))
  start, state, versions = initial_state(trainer, ckpt, base, resuming, workdir, log)

  # Points logged after the resumed checkpoint (before an interruption) are replaced.
  writer = create_writer(os.path.join(tb_dir, tb_layout.RL_RUN), enabled=primary,
                         purge_step=start + 1 if start else None, tags=tb_layout.tag)
  try:
    summary = _train(trainer, ckpt, writer, workdir, start, state, versions, log,
                     reevaluate=reevaluate and start == setup.loop.steps, stop=stop)
  finally:
    writer.close()  # flushes: points logged before an error are kept
    ckpt.wait()  # a save still in flight is completed and verified, also after an error
  summary["wall_s"] = time.time() - t0
  if primary:
    run_logs.write_json(workdir, run_logs.SUMMARY, summary)
  ev0, ev1 = summary["eval_start"], summary["eval_end"]
  log(f"[eval] held-out pass@1: start {ev0['pass_at_1']:.3f} -> end {ev1['pass_at_1']:.3f}; "
      f"greedy: start {ev0['greedy']:.3f} -> end {ev1['greedy']:.3f} "
      f"(elapsed {summary['wall_s']:.0f}s)")
  return summary


def _eval_start(trainer: Trainer, writer, workdir: str, start: int, params,
                eval_key: jax.Array, log: Log) -> dict[str, float]:
  """The step-0 evaluation: run (and logged) at a fresh start, read back when resuming."""
  primary = distributed.is_primary()
  if start:
    eval_start = run_logs.read_json(workdir, run_logs.EVAL_START, run_logs.EVAL_START_FIX)
    if primary:
      run_logs.trim_metrics(workdir, start)
    return eval_start
  if primary:
    open(os.path.join(workdir, run_logs.METRICS), "w").close()
  ev = trainer.evaluate(params, eval_key)
  log(f"[eval] step 0 held-out pass@1 {ev['pass_at_1']:.3f} greedy {ev['greedy']:.3f}")
  record = trainer.setup.record
  writer.scalars(0, {f"eval/{k}": v for k, v in ev.items()})
  writer.texts(0, {"config": "```\n" + record.text + "\n```"})
  writer.hparams(record.hparams, ["eval/pass_at_1", "eval/greedy", "reward/mean"])
  writer.custom_scalars(tb_layout.custom_scalars())
  if primary:
    run_logs.write_json(workdir, run_logs.EVAL_START, ev)
  return ev


def _train(trainer: Trainer, ckpt: Checkpointer, writer, workdir: str, start: int,
           state: dict[str, Any], versions: VersionBuffer, log: Log, *,
           reevaluate: bool, stop: preemption.StopFlag | None = None) -> dict[str, Any]:
  """The RL steps from `start`, then the final evaluation; returns the summary (no wall time).

  When `stop` is set (SIGTERM/SIGINT) the step in progress finishes, is checkpointed and waited
  for, the logs are flushed, and preemption.Preempted is raised."""
  setup = trainer.setup
  knobs, schedule, fp = setup.loop, setup.schedule, setup.record.fingerprint
  primary = distributed.is_primary()
  params, opt_state = state["params"], state["opt_state"]
  ref_params = state.get("ref_params")
  base_key = jax.random.wrap_key_data(state["rng"])
  metrics_path = os.path.join(workdir, run_logs.METRICS)
  eval_key = jax.random.fold_in(base_key, -1 % 2**31)
  eval_start = _eval_start(trainer, writer, workdir, start, params, eval_key, log)

  # Only the schedule's versions need copies: the step donates (and so frees) `params`.
  copy = ((lambda t: storage.keep(t, knobs.version_storage)) if schedule.stale
          else (lambda t: t))
  versions.put(start, copy(params))
  churn = code_churn.CodeChurn(setup.model_cfg, setup.sampler_policy) if knobs.code_churn else None
  if churn is not None:
    churn.start(params)  # before the step donates them
  eta = run_logs.Eta(knobs.steps)
  zero_rewards = zero_reward.ZeroRewardWatch()
  skipped_in_a_row = 0
  if preemption.agreed(stop):  # signalled while the base trained or the programs compiled
    raise preemption.Preempted(stop.signame or "a signal", None, workdir)
  step_pace = pace.Pace(setup.lr_schedule, knobs.updates_per_step, knobs.batch_size)
  for step in range(start, knobs.steps):
    # -- the step: rollout from the sampler's version, then the update ----------------------
    step_pace.start()
    sv = schedule.sampler_version(step)
    every = knobs.diagnostics_every
    params, opt_state, m, info = trainer.rl_step(storage.use(versions.get(sv)), params,
                                                 opt_state, storage.use(ref_params),
                                                 step, jax.random.fold_in(base_key, step),
                                                 stale=sv != step,
                                                 probe=bool(every) and step % every == 0,
                                                 sampler_version=sv)
    versions.put(step + 1, copy(params))
    versions.evict_before(step + 1)
    if knobs.keep_reference and knobs.ref_reset_every and (step + 1) % knobs.ref_reset_every == 0:
      ref_params = storage.keep(params, knobs.ref_storage)
    done = step + 1

    # -- its metrics, evaluation and logging -------------------------------------------------
    m = {k: float(v) for k, v in log_order(m).items()}
    m.update({"sampler_version_lag": float(step - sv), "versions_held": float(len(versions))})
    if churn is not None:
      m.update(churn.after_step(params))
    tb_only = step_pace.scalars(step, m["response_length"])  # wall times: not in metrics.jsonl
    warning = zero_rewards.update(done, info["rewards"], info["examples"], info["completions"])
    if warning:
      log(warning)
    skipped_in_a_row = skipped_in_a_row + 1 if m["skipped_updates"] > 0 else 0
    if skipped_in_a_row:
      log(f"[warn] step {done}: {int(m['skipped_updates'])} optimizer step(s) skipped "
          "(non-finite loss, gradient or update)")
    if knobs.eval_every and done % knobs.eval_every == 0 and done < knobs.steps:
      ev = trainer.evaluate(params, eval_key)
      m.update({f"eval/{k}": v for k, v in ev.items()})
      log(f"[eval] step {done} held-out pass@1 {ev['pass_at_1']:.3f} greedy {ev['greedy']:.3f}")
    if done % knobs.log_every == 0 or done == knobs.steps:
      log_step(trainer, writer, metrics_path, done, params, m, info, eta, log, tb_only)
    if skipped_in_a_row >= knobs.max_skipped_steps:
      raise NonFiniteError(
          f"{skipped_in_a_row} consecutive steps (up to step {done}) had skipped optimizer "
          f"updates (non-finite loss, gradient or update); stopping. {ckpt.last_good_hint()} "
          "Lower --config.optimizer.lr or raise the precision, then re-run to resume from it "
          "(--allow_config_change), or raise --config.max_skipped_steps.")

    # -- the checkpoint (and a preemption's stop) --------------------------------------------
    if done % knobs.checkpoint_every == 0 or done == knobs.steps:
      writer.flush()  # the points up to the checkpoint survive a kill
    # The newest version is `params` itself: only older ones are saved separately.
    state = state_tree(params, opt_state, jax.random.key_data(base_key), ref_params,
                       {str(v): versions.get(v) for v in versions.versions() if v != done})
    stopping = preemption.agreed(stop)
    ckpt.save(done, trainer.checkpointed(state),  # a LoRA run: its adapters alone
              {"data_position": done, "step": done, "config_fingerprint": fp},
              force=done == knobs.steps or stopping or done in knobs.keep_steps)
    if stopping:
      ckpt.wait()
      writer.flush()
      raise preemption.Preempted(stop.signame or "a signal", done, workdir)
  ckpt.wait()

  ev_end = trainer.evaluate(params, eval_key)
  if not reevaluate:  # a re-evaluation must not add a second point at the last step
    writer.scalars(knobs.steps, {f"eval/{k}": v for k, v in ev_end.items()})
  lines = run_logs.read_metrics(workdir) if primary else []
  return {"eval_start": eval_start, "eval_end": ev_end, "steps": knobs.steps,
          "final_train_reward": lines[-1].get("reward/mean") if lines else None,
          "config_fingerprint": fp}
