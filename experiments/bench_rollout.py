r"""Compute per useful token of an RL step: shared prefill + decode compaction vs per-row + full,
and packed scoring and update (rl.pack_tokens) vs padded.

  python -m experiments.bench_rollout                      # (a) the main job, (b) long tail
  python -m experiments.bench_rollout --settings=tail --groups=1,4,8 --repeats=3

One process; every setting builds the loop's own `Trainer` (`setup.build` of configs/base.py with
the setting's overrides) and times, per interleaved round, for each path:
  rollout = `Trainer.rollout` (sampling in the sampler's precision, exact-mode re-scoring, the
            trainer's pi_old, rewards on the host): the rollout phase and the scoring;
  update  = the jitted RL step on that rollout (`Trainer.step`: batch, drift, update);
  step    = rollout + update.
Paths: "before" = one prefill per row and one decode bucket (every row decodes until the last one
stops), the program before shared prefill and compaction; "after" = the loop's default: one prefill per prompt group
(`generate`'s group_size) and decode compaction (`sampler_decode_min_rows`). Both sample the same
tokens from the same keys (tests/sampling/test_shared_prefill.py, test_decode_compaction.py);
the benchmark checks it on every round. "packed" = "after" + packed scoring and update (a second
`Trainer` of the same config with rl.pack_tokens = --pack_width x the batch's width and
rl.pack_rows = --pack_rows); it also times `score` (`Trainer.score` alone on the rollout) and
reports the update's padding fraction (`pack/padding_frac`). With --finer=setting:k, a fourth
path "finer" = "packed" + k compaction buckets per halving (`sampler_decode_buckets_per_halving`).

Reported per setting, medians over rounds with [min-max], ratios taken per round (after/before, < 1
= less), and each ratio pooled over the rounds (sum over sum: the whole length distribution the
rounds drew; a round of short completions has little to save, so per-round ratios spread with
the batch):
  * process CPU seconds (the 2-core CPU is compute-bound: CPU time is compute) and wall seconds of
    rollout, update and step, and their ratios;
  * the model's row-token passes of the rollout per useful token (a count, no clock): prefill
    rows x P + every decode step's bucket rows, over the completion tokens kept (the useful
    tokens; prompts count once per group).
Settings: (a) `main`: the main job (mid-trained base, 32 prompts x 8, 8 new tokens); (c) `real`:
configs/smollm2.py (SmolLM2-135M-Instruct, --real_recipe, --real_prompts x 4 completions of up to
--real_tokens tokens, compaction buckets 8, 4, 2 rows; ~9.3 GB peak RSS, 5 min with --repeats=5,
docs/benchmarks.md); (b) `tail`:
long-tailed completions up to --tail_tokens (the main job's model, untied head, from random init
on the sorting task: the stop token has probability ~1/V at every position, so lengths are
geometric, median ~V ln 2, a few rows running far longer), --tail_rows rows at each group size of --groups.
"""
from __future__ import annotations

import json
import os
import time

from absl import app, flags
import jax
import jax.numpy as jnp
import numpy as np

from configs import base as base_config
from lowrl import user_cache
from lowrl.sampling import Sampler
from lowrl.sampling.generate import bucket_sizes, prefill_group
from lowrl.training import base_store
from lowrl.training.setup import build
from lowrl.training.trainer import Trainer

_SETTINGS = flags.DEFINE_list("settings", ["main", "tail"], "main | tail | real.")
_GROUPS = flags.DEFINE_list("groups", ["1", "8"], "Group sizes of the tail setting.")
_TAIL_ROWS = flags.DEFINE_integer("tail_rows", 64, "Rollout rows of the tail setting.")
_TAIL_TOKENS = flags.DEFINE_integer("tail_tokens", 256, "Completion budget of the tail setting.")
_TAIL_MIN_ROWS = flags.DEFINE_integer("tail_min_rows", 4, "sampler_decode_min_rows of the tail "
                                     "setting (the main setting runs the main job's default).")
_REAL_PROMPTS = flags.DEFINE_integer("real_prompts", 2, "Prompts of the real setting (x its "
                                    "group size 4).")
_REAL_TOKENS = flags.DEFINE_integer("real_tokens", 16, "Completion budget of the real setting.")
_REAL_RECIPE = flags.DEFINE_string("real_recipe", "bf16", "Precision recipe of the real setting.")
_REPEATS = flags.DEFINE_integer("repeats", 3, "Interleaved timed rounds (median and spread).")
_PACK_WIDTH = flags.DEFINE_list("pack_width", ["main:2", "tail:1", "real:2"],
                                "setting:k = the packed path's rl.pack_tokens = k x the batch's "
                                "width (prompt width + max_new_tokens).")
_PACK_ROWS = flags.DEFINE_list("pack_rows", ["main:16", "tail:4", "real:2"],
                               "setting:rows = the packed path's rl.pack_rows.")
_FINER = flags.DEFINE_list("finer", [], "setting:k = a fourth path, packed with k decode "
                           "compaction buckets per halving (e.g. tail:2); none by default.")
_OUT = flags.DEFINE_string("rounds_out", "", "Write every round's counts and times here (JSON).")
_COMPILE_CACHE = user_cache.define_compile_cache_flag()


class _PerRowPrefill:
  """The Sampler before shared prefill and compaction: every row prefilled on its own."""

  def __init__(self, sampler: Sampler):
    self.sampler = sampler

  def __call__(self, *args, group_size: int = 1, **kw):
    del group_size
    return self.sampler(*args, group_size=1, **kw)


def row_tokens(lengths_B: np.ndarray, prompt_width: int, group: int, sizes: tuple[int, ...],
               shards: int = 1) -> int:
  """Row-token passes of one rollout: the prefill's rows x P plus each decode step's bucket rows
  (`generate`: step i writes column i for i >= 1; a segment runs while some shard's live rows
  outnumber the next bucket's share; one shard here)."""
  batch, n = len(lengths_B), int(lengths_B.max())
  total = batch // group * prompt_width
  k = 0
  for i in range(1, n):  # the decode steps that run: until every row is done (or N)
    live = int((lengths_B > i).sum())  # rows still live when column i is written
    while k + 1 < len(sizes) and live <= sizes[k + 1] // shards:
      k += 1
    total += sizes[k]
  return total


def _config(setting: str, group: int):
  if setting == "real":  # configs/smollm2.py, small: few prompts, short completions
    from configs import smollm2
    c = smollm2.get_config(_REAL_RECIPE.value)
    c.rl.num_prompts = _REAL_PROMPTS.value
    c.rl.max_new_tokens = _REAL_TOKENS.value
    c.sampler_decode_min_rows = 2  # its 8 rows: buckets 8, 4, 2
    c.diagnostics.every = 0
    return c
  c = base_config.get_config()
  c.diagnostics.every = 0
  if setting == "tail":
    c.sft.steps = 0  # random init: the stop token is drawn with probability ~1/V per token
    c.model.tie_embeddings = False  # (a tied random head favours repeating the last token)
    c.sampler_decode_min_rows = _TAIL_MIN_ROWS.value
    c.rl.max_new_tokens = _TAIL_TOKENS.value
    c.rl.group_size = group
    c.rl.num_prompts = _TAIL_ROWS.value // group
  return c


def _per_setting(values: list[str], setting: str, default: int | None = None) -> int:
  return int(dict(v.split(":") for v in values).get(setting, default))


def _clock(fn):
  wall, cpu = time.perf_counter(), time.process_time()
  out = jax.block_until_ready(fn())
  return time.perf_counter() - wall, time.process_time() - cpu, out


def bench_setting(setting: str, group: int, repeats: int) -> dict:
  c = _config(setting, group)
  setup = build(c)
  trainer = Trainer(setup, log=lambda s: None)
  params = base_store.load_base(setup.base, setup.task, setup.model_cfg, setup.plan, "",
                                lambda s: None)
  params = trainer.place(params)
  after = trainer.sampler
  before = _PerRowPrefill(Sampler(setup.model_cfg, setup.sampler_policy, setup.sampling,
                                  exact=setup.loop.sampler_exact, plan=setup.plan,
                                  record_routing=setup.model_cfg.is_moe))
  # "packed": the default path + packed scoring and update (rl.pack_tokens, rl.pack_rows).
  width = setup.task.max_prompt_len + setup.sampling.max_new_tokens
  c.rl.pack_tokens = _per_setting(_PACK_WIDTH.value, setting) * width
  c.rl.pack_rows = _per_setting(_PACK_ROWS.value, setting)
  packed = Trainer(build(c), log=lambda s: None)
  finer_k = _per_setting(_FINER.value, setting, 1)
  finer = None
  if finer_k > 1:  # "finer": packed + finer compaction buckets
    c.sampler_decode_buckets_per_halving = finer_k
    finer = Trainer(build(c), log=lambda s: None)
  opt_state = trainer.init_opt_state(params)
  ref = jax.tree.map(jnp.copy, params)
  rows = setup.loop.batch_size
  min_rows = setup.loop.sampler_decode_min_rows
  shards = setup.plan.batch_shards
  sizes = bucket_sizes(rows, shards, min_rows)
  finer_sizes = bucket_sizes(rows, shards, min_rows, finer_k)
  g = prefill_group(rows, setup.loop.group_size, shards, setup.sampler_policy)
  paths = ("before", "after", "packed") + (("finer",) if finer is not None else ())
  times = {p: {k: [] for k in ("rollout", "score", "update", "step")} for p in paths}
  counts = {}

  def one(path, step, key):
    tr = {"packed": packed, "finer": finer}.get(path, trainer)
    trainer.sampler = before if path == "before" else after
    w, c_, (rollout, info) = _clock(lambda: tr.rollout(params, params, step, key, stale=False))
    # The trainer's scoring program alone (pi_old of a stale sampler, the drift's stale score):
    # one pass over the rollout, padded or packed.
    ws, cs, _ = _clock(lambda: tr.score(params, setup.trainer_policy, rollout.out, key))
    p_copy, o_copy = jax.tree.map(jnp.copy, (params, opt_state))
    jax.block_until_ready((p_copy, o_copy))
    wu, cu, (_, _, m) = _clock(lambda: tr.step(p_copy, o_copy, ref, rollout,
                                               jax.random.fold_in(key, 1)))
    return (w, c_), (ws, cs), (wu, cu), rollout, float(m["pack/padding_frac"])

  for r in range(repeats + 1):  # round 0 compiles
    key = jax.random.fold_in(jax.random.key(0), r)
    got = {}
    for path in paths:
      got[path] = one(path, r, key)
    a = got["before"][3].out
    if not all(bool(jnp.all(a.tokens == got[p][3].out.tokens)) for p in paths):
      print(f"  round {r}: the paths sampled different tokens (a near-tie rounded apart)")
    if r == 0:
      continue
    for path in paths[1:]:
      counts.setdefault(f"padding_{path}", []).append(got[path][4])
    lengths = np.asarray(a.completion_lengths)
    useful = int(lengths.sum())
    p = a.prompt_width
    counts.setdefault("before", []).append(row_tokens(lengths, p, 1, (rows,)) / useful)
    counts.setdefault("after", []).append(row_tokens(lengths, p, g, sizes, shards) / useful)
    counts.setdefault("finer", []).append(row_tokens(lengths, p, g, finer_sizes, shards) / useful)
    counts.setdefault("lengths", []).append(lengths)
    counts.setdefault("useful", []).append(useful)
    for path in paths:
      (w, cpu), score, (wu, cu), _, _ = got[path]
      for k, v in (("rollout", (w, cpu)), ("score", score), ("update", (wu, cu)),
                   ("step", (w + wu, cpu + cu))):
        times[path][k].append(v)
  return {"times": times, "counts": counts, "rows": rows, "group": setup.loop.group_size,
          "prefill_group": g, "sizes": sizes, "new_tokens": setup.sampling.max_new_tokens,
          "finer_sizes": finer_sizes if finer is not None else None,
          "pack": (c.rl.pack_tokens, c.rl.pack_rows, width)}


def _fmt(v):
  return f"{np.median(v):.3f} [{min(v):.3f}-{max(v):.3f}]"


def pooled(num: list[float], den: list[float], weights: list[float] | None = None) -> float:
  """sum(w * num) / sum(w * den) over rounds: the ratio over the whole length distribution the
  rounds drew, which a median of per-round ratios is not (a round of short completions has
  little to save)."""
  w = np.ones(len(num)) if weights is None else np.asarray(weights, float)
  return float(np.dot(w, num) / np.dot(w, den))


def pooled_interval(num: list[float], den: list[float], resamples: int = 10_000,
                    seed: int = 0) -> tuple[float, float]:
  """95% percentile bootstrap of `pooled(num, den)` over rounds (rounds resampled as units: each
  is another draw of the length distribution). At 8 rounds it covers a little under 95%."""
  num, den = np.asarray(num, float), np.asarray(den, float)
  idx = np.random.default_rng(seed).integers(0, len(num), (resamples, len(num)))
  lo, hi = np.percentile(num[idx].sum(1) / den[idx].sum(1), [2.5, 97.5])
  return float(lo), float(hi)


def report(name: str, res: dict) -> None:
  t, cnt = res["times"], res["counts"]
  lengths = np.concatenate(cnt["lengths"])
  print(f"\n== {name}: {res['rows']} rows, group {res['group']} (prefill shared by "
        f"{res['prefill_group']}), buckets {res['sizes']}, N {res['new_tokens']}; completion "
        f"length median {np.median(lengths):.0f}, mean {lengths.mean():.1f}, p90 "
        f"{np.percentile(lengths, 90):.0f}, max {lengths.max()}")
  ratio = [a / b for a, b in zip(cnt["after"], cnt["before"])]
  u = cnt["useful"]
  print(f"row-token passes per useful token: before {_fmt(cnt['before'])}, after "
        f"{_fmt(cnt['after'])}, ratio {_fmt(ratio)}, pooled over rounds "
        f"{pooled(cnt['after'], cnt['before'], u):.3f}")
  if res["finer_sizes"]:
    ratio = [a / b for a, b in zip(cnt["finer"], cnt["before"])]
    print(f"finer buckets {res['finer_sizes']}: row-token passes per useful token "
          f"{_fmt(cnt['finer'])}, ratio to before {_fmt(ratio)}, pooled over rounds "
          f"{pooled(cnt['finer'], cnt['before'], u):.3f}")
  tokens, rows, width = res["pack"]
  print(f"packed: rows of {tokens} tokens (batch width {width}), {rows} rows per shard per "
        f"micro-batch; update padding fraction padded {_fmt(cnt['padding_after'])}, packed "
        f"{_fmt(cnt['padding_packed'])}")
  def ratio(u, v):  # per round, then the pooled ratio of sums (same batches on every path)
    lo, hi = pooled_interval(u, v)
    return f"{_fmt([x / y for x, y in zip(u, v)])} pooled {pooled(u, v):.3f} [{lo:.3f}-{hi:.3f}]"

  for clock, i in (("cpu", 1), ("wall", 0)):
    for phase in ("rollout", "score", "update", "step"):
      b, a, p = ([x[i] for x in t[path][phase]] for path in ("before", "after", "packed"))
      print(f"{clock:>4} {phase:<8} before {_fmt(b)} s  after {_fmt(a)} s  packed {_fmt(p)} s"
            f"  after/before {ratio(a, b)}  packed/after {ratio(p, a)}  packed/before "
            f"{ratio(p, b)}")
      if "finer" in t:
        f = [x[i] for x in t["finer"][phase]]
        print(f"{'':>4} {'':<8} finer {_fmt(f)} s  finer/packed {ratio(f, p)}  finer/before "
              f"{ratio(f, b)}")


def main(argv):
  del argv
  user_cache.enable_compile_cache()
  print(f"backend {jax.default_backend()}, {os.cpu_count()} CPUs, load average at start "
        f"{os.getloadavg()[0]:.1f}, {_REPEATS.value} interleaved rounds after a compile round")
  results = {}
  for setting in _SETTINGS.value:
    groups = {"main": [8], "real": [4]}.get(setting) or [int(g) for g in _GROUPS.value]
    for group in groups:
      res = bench_setting(setting, group, _REPEATS.value)
      report(f"{setting} (group {group})", res)
      results[f"{setting}:{group}"] = res
  if _OUT.value:
    with open(_OUT.value, "w") as f:
      json.dump(results, f, default=lambda a: np.asarray(a).tolist())
  print(f"load average at end {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
  app.run(main)
