"""What a run shows: its setup (console), and each logged step's point (TensorBoard,
metrics.jsonl, the console line)."""
from __future__ import annotations

import os
from typing import Any

import jax
import numpy as np

from lowrl import distributed, precision
from lowrl.metrics import layout as tb_layout
from lowrl.models import init, layout
from lowrl.tasks.jsonl import JsonlTask
from lowrl.training import run_config, run_logs
from lowrl.training.setup import Setup, describe_memory
from lowrl.training.step import BATCH_METRICS
from lowrl.training.trainer import Log, Trainer


def log_setup(setup: Setup, workdir: str, log: Log) -> None:
  """The run's static setup: task, model, recipes, schedule, precision table, mesh, memory."""
  if setup.base.hf_checkpoint:
    log(f"[setup] model {setup.base.hf_checkpoint} (scan_layers={setup.model_cfg.scan_layers}); "
        f"completions stop at eos ids {setup.sampling.stop_tokens}")
  log(f"[setup] task={setup.loop.task_name} model={setup.model_cfg.num_params():,} params "
      f"trainer={setup.trainer_policy.name} sampler={setup.sampler_policy.name} "
      f"async lag={setup.schedule.lag} sync_every={setup.schedule.sync_every} "
      f"config {setup.record.fingerprint} ({os.path.join(workdir, run_config.CONFIG_FILE)})")
  if isinstance(setup.task, JsonlTask):  # a file's split: how much there is to train and test on
    task = setup.task
    n_train, n_eval = len(task.examples("train")), len(task.examples("eval"))
    log(f"[setup] {task.path}: {n_train} train / {n_eval} eval examples (eval_fraction "
        f"{task.eval_fraction:g} of the distinct prompts, by prompt hash); the held-out "
        f"evaluation draws eval_num_prompts={setup.loop.eval_num_prompts} of the {n_eval} "
        "(with replacement)")
  log(precision.format_table(precision.assignment_table(setup.trainer_policy,
                                                          layout.matmuls(setup.model_cfg))))
  log(f"[mesh] {dict(setup.plan.mesh.shape)} over {jax.device_count()} {jax.default_backend()} "
      f"devices, {jax.process_count()} process(es)")
  for note in setup.plan.fallbacks(init.param_shapes(setup.model_cfg)):
    log(f"[mesh] {note}")
  log(describe_memory(setup))
  cache_note = setup.plan.cache_note(setup.model_cfg)
  if cache_note:
    log(f"[warn] {cache_note}")


def log_order(metrics: dict[str, Any]) -> dict[str, Any]:
  """The step's metrics in metrics.jsonl's column order: the update's, the drift parts, then
  `make_batch`'s (a jitted dict comes back sorted)."""
  drift = sorted(k for k in metrics if k.startswith("drift/"))
  update = sorted(k for k in metrics if k not in BATCH_METRICS and not k.startswith("drift/"))
  return {k: metrics[k] for k in (*update, *drift, *BATCH_METRICS)}


def log_step(trainer: Trainer, writer, metrics_path: str, done: int, params,
             m: dict[str, float], info: dict[str, Any], eta: run_logs.Eta, log: Log,
             tb_only: dict[str, float]) -> None:
  """Step `done`'s point: weight quantization errors added to `m`, TensorBoard (`m` and
  `tb_only`), metrics.jsonl (`m`), the console line."""
  knobs = trainer.setup.loop
  werr = {k: float(v) for k, v in trainer.weight_errors(params).items()}
  if werr:
    writer.histograms(done, {tb_layout.WEIGHT_ERROR_HISTOGRAM:
                             100 * np.array(list(werr.values()))})
    m.update({f"quant_error/{k}": v for k, v in werr.items()})
  writer.scalars(done, {**m, **tb_only})
  writer.texts(done, {"samples": sample_text(info, knobs.num_text_samples)})
  if distributed.is_primary():
    with open(metrics_path, "a") as f:
      f.write(run_logs.metrics_line(done, m) + "\n")
  log(f"[rl] step {done}/{knobs.steps} reward {m['reward/mean']:.3f} "
      f"pass {m['reward/pass_rate']:.3f} mismatch_kl {m['mismatch/mismatch_kl']:.2e} "
      f"ess {m['mismatch/ess']:.3f} len {m['response_length']:.1f} {eta.update(done)}")


def sample_text(info: dict[str, Any], n: int) -> str:
  """The step's first `n` completions as markdown (prompt -> completion, answer, reward)."""
  rows = []
  for e, c, r in list(zip(info["examples"], info["completions"], info["rewards"]))[:n]:
    rows.append(f"`{e.prompt}` -> `{c}` (answer `{e.answer}`, reward {r:g})")
  return "\n\n".join(rows)
