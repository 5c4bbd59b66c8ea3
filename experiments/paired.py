r"""Paired forward-only and backward measurements of the recipe's claims, on the ablation's base.

  python -m experiments.paired --workdir=/tmp/lowrl_ablate          # configs/ablate.py's grid
  python -m experiments.paired --workdir=W --config.quick=True      # the quick grid's sizes

W is an experiments.ablate workdir (its mid-trained base `<W>/base` is reused, or trained once);
the results go to `<W>/paired.jsonl` (one line per measurement, resumable: lowrl.grid), which
experiments/report (a package: a module per question) turns into claims.

Identical inputs for every arm (so each comparison is paired and the noise of sampling cancels):
`batches` rollout batches are sampled once, from the base in BF16 (the `twin` setting's trainer,
the training prompts of steps 0, 1, ...), with their rewards.

forward ladder  every rung's forward (nvfp4_naive -> +per_token -> +4/6 -> +bf16_tail, each
                 setting's trainer precision, its scales from the batch as the trainer computes
                 them) scores the same tokens with the same weights; per position the exact KL over
                 the whole vocabulary, KL(rung || BF16) (lowrl.rl.kl.exact_kl, the sampled
                 distribution q of rl.temperature / top-k / top-p), averaged over each
                 completion's positions, then over each prompt's completions: one number per
                 prompt and rung. A claim: a rung lowers it, paired over prompts. When the grid
                 plants outlier channels (run.sft.outlier_channels), the ladder runs again on the
                 stored base without them (same tokens): outliers as a paired factor.
backward        on the first `grad_batches` batches, the RL loss's gradient (lowrl.training.probes
                 make_grad_fn: one pass, pi_old in the gradient's own precision) of the 4-bitter
                 recipe's forward with each backward mode (high_precision, dequantized = the
                 recipe, quantized) against (a) the FP32 gradient of the unquantized model and
                 (b) the dequantized backward's, which is the exact chain rule of the quantized
                 forward with straight-through rounding (its own (b) is 1 by definition):
                 cosine and relative error per batch. Outcome: one optimizer step (the run's
                 AdamW, fresh state) from the base on each mode's gradient of the batch, and the
                 change of the FP32 policy-gradient surrogate -mean(A * log pi) on `heldout`
                 other batches (pi_old = the base; lower is better), and the fraction of the
                 recipe's NVFP4 weight codes that step changes (code_churn): per batch and mode;
                 and the fraction of every quantized forward's weight codes and block scales
                 (the ladder's rungs and the recipe) the dequantized step changes.
                 Again mid-run (`point` "mid: ..."): the same design on the weights of the
                 grid's nvfp4_recipe run of the first seed at its kept checkpoint nearest half
                 the run, on batches (the same prompts and keys) sampled in BF16 from them.
distance        for every finished run of the grid (results.jsonl) in `paired.distance_groups`
                 (all groups when empty), its distance to BF16 in two
                 parts, static and trajectory (`distance`), on held-out tokens sampled once from
                 the base in BF16, at step 0, at every checkpoint the run kept
                 (run.checkpoint_keep_fractions: configs/ablate.py keeps 25% and 50%) and at the
                 end; paired by seed in the report.
"""
from __future__ import annotations

import functools
import os
from typing import Any, Callable

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

from experiments import ablate
from lowrl import grid as lowrl_grid
from lowrl import precision, user_cache
from lowrl.models import layout, transformer
from lowrl.rl.kl import exact_kl
from lowrl.sampling.distributions import sampling_logits
from lowrl.training import code_churn, loop, optimizer, probes, run_config
from lowrl.training.setup import Setup, build, keep_steps
from lowrl.training.checkpointing import Checkpointer
from lowrl.training.state import CHECKPOINTS, params_at
from lowrl.training.trainer import Trainer
from lowrl.training.rl_update import make_logprob_fn
from lowrl.training.step import make_batch

Log = Callable[[str], None]
RESULTS = "paired.jsonl"
LADDER = ("nvfp4_naive", "+per_token", "+4/6", "+bf16_tail")
# backward mode -> the setting whose trainer precision it is ('' = the recipe with that backward).
BACKWARD = {"high_precision": "", "dequantized": "nvfp4_recipe", "quantized": "nvfp4_recipe_qbwd"}


def sizes(cfg: ml_collections.ConfigDict) -> dict[str, int]:
  """How many batches the measurements use: `cfg.paired` (configs/ablate.py), smaller when quick."""
  p = cfg.paired
  if cfg.quick:
    return {"batches": int(p.quick_batches), "grad_batches": int(p.quick_grad_batches),
            "heldout": int(p.quick_heldout)}
  return {"batches": int(p.batches), "grad_batches": int(p.grad_batches),
          "heldout": int(p.heldout)}


def all_settings(cfg: ml_collections.ConfigDict) -> dict[str, ablate.Setting]:
  """Every setting of the grid's rows (`cfg.grid`), whatever `groups` / `only` choose."""
  c = ml_collections.ConfigDict(cfg.to_dict())
  c.groups = tuple(sorted({r["group"] for r in cfg.grid}))
  c.only = ()
  return {s.name: s for s in ablate.settings(c)}


def _setting_config(cfg, setting: ablate.Setting, base_dir: str) -> ml_collections.ConfigDict:
  c = setting.config(cfg.run, int(cfg.seeds[0]))
  c.sft.base_dir = base_dir
  return c


@functools.partial(jax.jit, static_argnames=("model_cfg", "policy", "ref_policy", "sampling"))
def _kl_per_row(params, ref_params, tokens_BL, mask_BL, completion_BL, quant_key, *, model_cfg,
                policy, ref_policy, sampling):
  """Per row: the mean over its completion tokens of KL(q_policy || q_ref) at the positions that
  predict them (exact, full vocabulary)."""
  def q_logits(p, pol):
    logits = transformer.forward(p, tokens_BL, model_cfg, pol, mask_BT=mask_BL,
                                 quant_key=quant_key if pol.needs_key else None)
    return sampling_logits(logits[:, :-1], sampling)  # column t predicts token t + 1
  kl_BT = exact_kl(q_logits(params, policy), q_logits(ref_params, ref_policy))
  m_BT = completion_BL[:, 1:]
  return jnp.sum(kl_BT * m_BT, 1) / jnp.maximum(jnp.sum(m_BT, 1), 1.0)


def _per_prompt(rows_B: np.ndarray, group: int) -> np.ndarray:
  return rows_B.reshape(-1, group).mean(1)


def sample_batches(trainer: Trainer, params, n: int, first_step: int = 0) -> list[Any]:
  """`n` rollouts of the trainer's sampler from `params` (training prompts of steps first_step,
  ...; the step's key), their rewards included."""
  key = jax.random.key(trainer.setup.loop.seed)
  return [trainer.rollout(params, params, s, jax.random.fold_in(key, s), stale=False)[0]
          for s in range(first_step, first_step + n)]


def forward_ladder(cfg, setups: dict[str, Setup], twin: Setup, params, rollouts,
                   log: Log, unplanted=None) -> dict[str, Any]:
  """{"units": "prompts", "kl": {rung: [per-prompt KL(rung || twin)]}, "prompts_per_batch"}
  (module docstring; the prompts in batch order);
  with `unplanted` (the base without the grid's planted outlier channels, run.sft.outlier_channels:
  the same function in exact arithmetic) also "kl_unplanted", the same rungs on those weights
  and the same tokens: outliers as a factor paired by prompt."""
  group = cfg.run.rl.group_size

  def ladder(weights, label: str) -> dict[str, list[float]]:
    out = {}
    for name in LADDER:
      s = setups[name]
      p = optimizer.to_master(weights, s.loop.master_dtype)
      ref = optimizer.to_master(weights, twin.loop.master_dtype)
      rows = [np.asarray(_kl_per_row(
          p, ref, r.out.tokens, r.out.attention_mask, r.out.completion_mask,
          jax.random.fold_in(jax.random.key(s.loop.seed), i), model_cfg=s.model_cfg,
          policy=s.trainer_policy, ref_policy=twin.trainer_policy, sampling=s.sampling))
          for i, r in enumerate(rollouts)]
      out[name] = _per_prompt(np.concatenate(rows), group).tolist()
      log(f"[paired] ladder{label} {name}: KL to BF16 {np.mean(out[name]):.4f} over "
          f"{len(out[name])} prompts")
    return out

  # Prompts of one batch share its sampling key and activation scales: the report clusters by it.
  result = {"units": "prompts", "kl": ladder(params, ""),
            "prompts_per_batch": int(rollouts[0].out.tokens.shape[0]) // group}
  if unplanted is not None:
    result["kl_unplanted"] = ladder(unplanted, " (outliers not planted)")
  return result


def _backward_setups(cfg, settings: dict[str, ablate.Setting], base_dir: str
                     ) -> dict[str, Setup]:
  out = {}
  for mode, name in BACKWARD.items():
    if name:
      s = settings[name]
    else:  # the recipe with this backward: not a setting of the grid
      s = ablate.Setting(f"nvfp4_recipe_{mode}", "paired", ablate._recipe(  # noqa: SLF001
          "nvfp4_recipe", f"nvfp4_recipe_{mode}", backward=mode))
    out[mode] = build(_setting_config(cfg, s, base_dir))
  return out


# `backward`'s programs, built once per process and setting: a second call (the design mid-run,
# experiments/real_ladder.py's chunks) neither traces nor compiles them again. Called with every
# argument positional (one cache entry per program).
_agree = jax.jit(probes.grad_agreement)
_churn = jax.jit(code_churn.churn)
_codes = jax.jit(code_churn.weight_qtensors, static_argnames=("model_cfg", "policy"))


def _fp32_policy(model_cfg) -> precision.PrecisionPolicy:
  return precision.PrecisionPolicy.unquantized(layout.matmuls(model_cfg), "float32", name="fp32")


@functools.lru_cache(maxsize=None)
def _grad_program(model_cfg, policy, sampling, update_cfg, batch_cfg, param_dtype):
  """The jitted RL-loss gradient of `policy`'s forward (probes.make_grad_fn)."""
  return jax.jit(probes.make_grad_fn(make_logprob_fn(model_cfg, policy, sampling), update_cfg,
                                     batch_cfg, param_dtype=param_dtype))


@functools.lru_cache(maxsize=None)
def _step_program(tx):
  """One step of the optimizer `tx` from a fresh state."""
  @jax.jit
  def step(p, g):
    new, _ = optimizer.apply_update(tx, p, g, optimizer.init_opt_state(tx, p),
                                    master_rounding="nearest", key=None)
    return new
  return step


@functools.lru_cache(maxsize=None)
def _surrogate_program(model_cfg, sampling, batch_cfg):
  """The FP32 policy-gradient surrogate -mean(A * log pi) of a rollout (pi_old = its scores)."""
  logprob32 = make_logprob_fn(model_cfg, _fp32_policy(model_cfg), sampling)

  @jax.jit
  def surrogate(p, rollout):
    batch, _ = make_batch(rollout.out, rollout.rewards_B, batch_cfg)
    logp_BT, _ = logprob32(optimizer.to_master(p, "float32"), batch, None)
    m_BT = batch.loss_mask_BT
    return -jnp.sum(batch.adv_B[:, None] * logp_BT * m_BT) / jnp.maximum(jnp.sum(m_BT), 1.0)
  return surrogate


def backward(cfg, setups: dict[str, Setup], params, rollouts, heldout, log: Log,
             forwards: dict[str, Setup] | None = None) -> dict[str, Any]:
  """Per batch and backward mode: cos / rel_err vs FP32 and vs the dequantized (exact
  quantized-forward) gradient, and the held-out surrogate's change after one step. With
  `forwards` ({setting: Setup}), "churn_by_forward": per setting, the fraction of its trainer
  forward's weight codes (and block scales) the dequantized step changes, per batch: how much of
  one update each quantized forward "sees"."""
  any_setup = next(iter(setups.values()))
  model_cfg, sampling = any_setup.model_cfg, any_setup.sampling
  update_cfg, batch_cfg = any_setup.update_cfg, any_setup.batch_cfg
  grad_fns = {m: _grad_program(model_cfg, s.trainer_policy, sampling, update_cfg, batch_cfg, None)
              for m, s in setups.items()}
  grad32 = _grad_program(model_cfg, _fp32_policy(model_cfg), sampling, update_cfg, batch_cfg,
                         "float32")
  step = _step_program(any_setup.tx)
  surrogate = _surrogate_program(model_cfg, sampling, batch_cfg)

  def heldout_loss(p):
    return float(np.mean([float(surrogate(p, h)) for h in heldout]))

  params = optimizer.to_master(params, any_setup.loop.master_dtype)
  ref_params = params if any_setup.loop.keep_reference else None
  base_loss = heldout_loss(params)
  # The update's code churn (lowrl.training.code_churn): the fraction of the recipe's NVFP4
  # weight codes one step on each mode's gradient changes, from the base's codes.
  # Keys: the backward modes, then the `forwards`' setting names (disjoint).
  forwards = forwards or {}
  policies = {k: s.trainer_policy for k, s in {**setups, **forwards}.items()}

  def churn_of(k: str, new) -> dict[str, jax.Array]:
    # The base's codes are recomputed at each use (the same program on the same weights: the
    # same codes) rather than kept for all the settings at once: on a real model they are ~0.1 GB
    # per setting, beside gradients of 0.5 GB each (docs/real_model.md).
    codes = functools.partial(_codes, model_cfg=model_cfg, policy=policies[k])
    return _churn(codes(params), codes(new))

  by_forward = {f: {"codes": [], "scales": []} for f in forwards}
  rows = {m: {"cos_fp32": [], "rel_err_fp32": [], "cos_exact": [], "rel_err_exact": [],
              "heldout_delta": [], "code_churn": []} for m in setups}
  rows["fp32"] = {"heldout_delta": []}
  key = jax.random.key(any_setup.loop.seed)
  for b, r in enumerate(rollouts):
    k = jax.random.fold_in(key, b)
    # Held at once: the two references (FP32, dequantized) and one other mode's gradient; each
    # mode's gradient and stepped weights are dropped once its row is written.
    g32 = grad32(params, ref_params, r, k)
    g_exact = grad_fns["dequantized"](params, ref_params, r, k)
    for m in setups:
      g = g_exact if m == "dequantized" else grad_fns[m](params, ref_params, r, k)
      a32, aex = _agree(g, g32), _agree(g, g_exact)
      rows[m]["cos_fp32"].append(float(a32["grad_bias/cos/total"]))
      rows[m]["rel_err_fp32"].append(float(a32["grad_bias/rel_err/total"]))
      rows[m]["cos_exact"].append(float(aex["grad_bias/cos/total"]))
      rows[m]["rel_err_exact"].append(float(aex["grad_bias/rel_err/total"]))
      new = step(params, g)
      del g
      rows[m]["heldout_delta"].append(heldout_loss(new) - base_loss)
      c = churn_of(m, new)
      rows[m]["code_churn"].append(float(c["code_churn/codes"]) if c else 0.0)
      if m == "dequantized":
        for f in forwards:
          c = churn_of(f, new)
          by_forward[f]["codes"].append(float(c["code_churn/codes"]) if c else 0.0)
          by_forward[f]["scales"].append(float(c["code_churn/scales"]) if c else 0.0)
      del new
    del g_exact
    rows["fp32"]["heldout_delta"].append(heldout_loss(step(params, g32)) - base_loss)
    del g32
    log(f"[paired] backward batch {b + 1}/{len(rollouts)}: cos vs FP32 " + ", ".join(
        f"{m} {rows[m]['cos_fp32'][-1]:.4f}" for m in setups))
  out = {"units": "batches", "heldout_base": base_loss, "modes": rows}
  if forwards:
    out["churn_by_forward"] = by_forward
  return out


def _row_kl(params, ref_params, outs, setup: Setup, policy, ref_policy) -> np.ndarray:
  """Per row of `outs` (SampleOutputs): KL(q_{params, policy} || q_{ref_params, ref_policy})."""
  key = jax.random.key(setup.loop.seed)
  return np.concatenate([np.asarray(_kl_per_row(
      params, ref_params, o.tokens, o.attention_mask, o.completion_mask,
      jax.random.fold_in(key, i), model_cfg=setup.model_cfg, policy=policy,
      ref_policy=ref_policy, sampling=setup.sampling)) for i, o in enumerate(outs)])


def checkpoint_steps(setup: Setup, run_dir: str) -> list[int]:
  """The steps at which a finished run's distance is measured: its kept checkpoints
  (checkpoint_keep_fractions) that are on disk, and its last step."""
  on_disk = set(Checkpointer(os.path.join(run_dir, CHECKPOINTS),
                             every=setup.loop.checkpoint_every).all_steps())
  return sorted({s for s in setup.loop.keep_steps if s in on_disk} | {setup.loop.steps})


def distance(cfg, workdir: str, line: dict[str, Any], twin_line: dict[str, Any],
             settings: dict[str, ablate.Setting], base, log: Log) -> dict[str, Any]:
  """The run's distance to BF16 in two parts on identical tokens (the held-out prompts'
  completions sampled once from the base in BF16, `eval_samples` each; the same for every run of
  the seed), exact full-vocabulary KL per token averaged per prompt, at every point of the run:
  step 0 (the base), each checkpoint it kept (run.checkpoint_keep_fractions, e.g. 25% and 50%
  of rl.steps) and the end:
    static      KL(run's weights under its recipe || the same weights in BF16): the
                quantization of the forward alone;
    trajectory  KL(run's weights in BF16 || its BF16 twin's weights at the same step, in BF16):
                where training took the weights (0 at step 0 by construction: both are the
                base, not measured; None at a step the twin has no checkpoint of).
  Returns {"setting", "seed", "units", "steps": rl.steps, "points": [{"step", "fraction",
  "static": [per prompt], "trajectory": [per prompt] | None}, ...]}."""
  base_dir = os.path.join(workdir, "base")
  seed = int(line["seed"])
  c = settings[line["setting"]].config(cfg.run, seed)
  c.sft.base_dir = base_dir
  tc = settings[twin_line["setting"]].config(cfg.run, seed)
  tc.sft.base_dir = base_dir
  twin = Trainer(build(tc), log=lambda _: None)
  setup = build(c)
  bf16 = twin.setup.trainer_policy
  base_t = twin.place(optimizer.to_master(base, tc.optimizer.master_dtype))
  # The same held-out tokens for every run of this seed: sampled from the base in BF16.
  outs = [o for o, _ in twin._eval_samples(base_t, jax.random.fold_in(jax.random.key(seed), 11),  # noqa: SLF001
                                           quant_key=None, act_amax=None)]
  run_dir = os.path.join(workdir, line["run_dir"])
  twin_dir = os.path.join(workdir, twin_line["run_dir"])
  twin_steps = set(checkpoint_steps(twin.setup, twin_dir))
  n = int(c.eval_samples)
  per_prompt = lambda rows: rows.reshape(-1, n).mean(1).tolist()  # noqa: E731
  start = optimizer.to_master(base, c.optimizer.master_dtype)
  steps = int(setup.loop.steps)
  static0 = per_prompt(_row_kl(start, start, outs, setup, setup.trainer_policy, bf16))
  points = [{"step": 0, "fraction": 0.0, "static": static0, "trajectory": [0.0] * len(static0)}]
  trainer = None
  for step in checkpoint_steps(setup, run_dir):
    trainer = trainer or Trainer(setup, log=lambda _: None)
    p = params_at(c, run_dir, step, trainer)
    traj = None
    if step in twin_steps:
      traj = per_prompt(_row_kl(p, params_at(tc, twin_dir, step, twin), outs, setup, bf16, bf16))
    points.append({"step": step, "fraction": step / steps,
                   "static": per_prompt(_row_kl(p, p, outs, setup, setup.trainer_policy, bf16)),
                   "trajectory": traj})
  log(f"[paired] distance {line['setting']} seed {seed}: " + ", ".join(
      f"step {q['step']} static {np.mean(q['static']):.4f} trajectory "
      + ("-" if q["trajectory"] is None else f"{np.mean(q['trajectory']):.4f}") for q in points))
  return {"setting": line["setting"], "seed": seed, "units": "held-out prompts", "steps": steps,
          "points": points}


def mid_run_point(cfg, grid_lines: list[dict[str, Any]],
                  settings: dict[str, ablate.Setting]) -> tuple[dict[str, Any], int] | None:
  """(the grid's nvfp4_recipe line of the first seed, its kept checkpoint step nearest half the
  run) for the backward design mid-run; None while that run has not finished or keeps no
  checkpoint before its end (run.checkpoint_keep_fractions)."""
  name, seed = BACKWARD["dequantized"], int(cfg.seeds[0])
  line = next((r for r in grid_lines if r["setting"] == name and int(r["seed"]) == seed), None)
  if line is None:
    return None
  c = _setting_config(cfg, settings[name], "")
  steps = int(c.rl.steps)
  kept = [k for k in keep_steps(c.checkpoint_keep_fractions, steps) if 0 < k < steps]
  if not kept:
    return None
  return line, min(kept, key=lambda k: (abs(k - steps / 2), k))


def backward_mid_run(cfg, workdir: str, line: dict[str, Any], step: int,
                     settings: dict[str, ablate.Setting], twin: Trainer, bwd: dict[str, Setup],
                     forwards: dict[str, Setup], n: dict[str, int], log: Log) -> dict[str, Any]:
  """`backward` on the weights of the grid run `line` (the first seed's) at checkpoint `step`:
  its batches and held-out batches are sampled in BF16 by `twin` from those weights (the base's
  prompts and keys)."""
  c = _setting_config(cfg, settings[line["setting"]], os.path.join(workdir, "base"))
  weights = params_at(c, os.path.join(workdir, line["run_dir"]), step)
  params = twin.place(optimizer.to_master(weights, twin.setup.loop.master_dtype))
  log(f"[paired] backward mid-run: {line['setting']} seed {line['seed']} at step {step}")
  out = backward(cfg, bwd, params, sample_batches(twin, params, n["grad_batches"]),
                 sample_batches(twin, params, n["heldout"], first_step=10_000), log,
                 forwards=forwards)
  return {**out, "weights": f"{line['setting']} seed {line['seed']} step {step}",
          "step": step, "steps": int(c.rl.steps)}


def run(cfg: ml_collections.ConfigDict, workdir: str, log: Log = print) -> list[dict[str, Any]]:
  """Runs (or resumes) the paired measurements of the grid config `cfg` on `<workdir>`'s base;
  returns the lines of `<workdir>/paired.jsonl`."""
  if cfg.quick:
    cfg = ablate.quick(cfg)
  n = sizes(cfg)
  if n["grad_batches"] > n["batches"] or min(n.values()) < 1:
    raise run_config.ConfigError(f"--config.paired: need 1 <= grad_batches <= batches and "
                                 f"heldout >= 1, got {n}.")
  settings = all_settings(cfg)
  base_dir = os.path.join(workdir, "base")
  twin_cfg = _setting_config(cfg, settings[cfg.twin], base_dir)
  setups = {name: build(_setting_config(cfg, settings[name], base_dir)) for name in LADDER}
  bwd = _backward_setups(cfg, settings, base_dir)  # validated before anything compiles
  os.makedirs(workdir, exist_ok=True)
  user_cache.enable_compile_cache()
  fp = run_config.fingerprint(twin_cfg)
  planted = int(cfg.run.sft.outlier_channels) > 0
  # What each line holds beyond the first version's: the ladder without the planted outliers,
  # the code churn under every quantized forward.
  extra = {"forward_ladder": "-unplanted" if planted else "", "backward": "-churn_fwd"}
  jobs = [lowrl_grid.Job.of({"measurement": m, "point": "base"},
                            f"{fp}-{m}-{n['batches']}-{n['grad_batches']}-{n['heldout']}"
                            + extra[m])
          for m in ("forward_ladder", "backward")]
  # The distance parts of every finished run of the grid (experiments.ablate's results.jsonl).
  grid_lines = ablate.read_results(workdir)
  twins = {r["seed"]: r for r in grid_lines if r["setting"] == cfg.twin}
  # A cosmetic knob (no run's fingerprint has it): the job's key says which points it measured.
  keep = ",".join(f"{f:g}" for f in cfg.run.checkpoint_keep_fractions)
  measured = set(cfg.paired.get("distance_groups", ())) or {s.group for s in settings.values()}
  for r in grid_lines:
    if (r["setting"] in settings and r["seed"] in twins
        and settings[r["setting"]].group in measured):
      jobs.append(lowrl_grid.Job.of(
          {"measurement": "distance", "point": f"{r['setting']} seed {r['seed']}"},
          f"{r['fingerprint']}-{twins[r['seed']]['fingerprint']}-keep{keep}",
          (r, twins[r["seed"]])))
  mid = mid_run_point(cfg, grid_lines, settings)
  if mid is not None:
    line, step = mid
    jobs.append(lowrl_grid.Job.of(
        {"measurement": "backward",
         "point": f"mid: {line['setting']} seed {line['seed']} step {step}"},
        f"{line['fingerprint']}-backward-mid{step}-{n['grad_batches']}-{n['heldout']}"
        + extra["backward"], mid))
  # Every quantized forward whose weight codes the dequantized step changes (code churn).
  forwards = {**setups, "nvfp4_recipe": bwd["dequantized"]}
  state: dict[str, Any] = {}

  def twin() -> Trainer:
    if "twin" not in state:
      state["twin"] = Trainer(build(twin_cfg), log=lambda _: None)
    return state["twin"]

  def base():
    if "base" not in state:
      state["base"] = loop.load_base(twin_cfg, os.path.join(workdir, "runs", "paired"), log=log)
    return state["base"]

  def inputs():
    if "params" not in state:
      params = twin().place(optimizer.to_master(base(), twin_cfg.optimizer.master_dtype))
      state.update(params=params, rollouts=sample_batches(twin(), params, n["batches"]),
                   heldout=sample_batches(twin(), params, n["heldout"], first_step=10_000))
      if planted:  # the stored base itself: the channels are planted when it is loaded
        off = ml_collections.ConfigDict(twin_cfg.to_dict())
        off.sft.outlier_channels = 0
        state["unplanted"] = twin().place(optimizer.to_master(
            loop.load_base(off, os.path.join(workdir, "runs", "paired"), log=log),
            twin_cfg.optimizer.master_dtype))
    return state

  def work(job: lowrl_grid.Job) -> dict[str, Any]:
    if dict(job.key)["measurement"] == "distance":
      return distance(cfg, workdir, *job.payload, settings, base(), log)
    if dict(job.key)["point"] != "base":
      return backward_mid_run(cfg, workdir, *job.payload, settings, twin(), bwd, forwards, n, log)
    s = inputs()
    if dict(job.key)["measurement"] == "forward_ladder":
      return forward_ladder(cfg, setups, twin().setup, s["params"], s["rollouts"], log,
                            unplanted=s.get("unplanted"))
    return backward(cfg, bwd, s["params"], s["rollouts"][:n["grad_batches"]], s["heldout"], log,
                    forwards=forwards)

  return lowrl_grid.run(jobs, os.path.join(workdir, RESULTS), work, log=log, tag="paired")


def read_results(workdir: str) -> dict[str, Any]:
  """{measurement: its line} of `<workdir>/paired.jsonl` ({} when absent); "distance": the list
  of the distance lines (one per run); "backward_mid": the backward design mid-run."""
  out: dict[str, Any] = {"distance": []}
  for r in lowrl_grid.read_results(os.path.join(workdir, RESULTS)):
    if r["measurement"] == "distance":
      out["distance"].append(r)
    elif r.get("point", "base") != "base":  # the backward design mid-run
      out[f"{r['measurement']}_mid"] = r
    else:
      out[r["measurement"]] = r
  return out


def main(argv):
  ablate.grid_main(_FLAGS, argv, lambda cfg, workdir, log: run(cfg, workdir, log=log))


if __name__ == "__main__":
  from absl import app

  from lowrl.training import cli

  _FLAGS = cli.define_run_flags("ablate.py", "/tmp/lowrl_ablate", "Grid directory.")
  app.run(main, flags_parser=_FLAGS.parser())
