r"""Repeat runs of the main job: a first run against a repeat run with the cache and base it left.

  python -m experiments.bench_repeat_run                      # 1 pair of default runs
  python -m experiments.bench_repeat_run --pairs=3 --out=/tmp/repeat.json
  python -m experiments.bench_repeat_run --train_flags=--config.rl.steps=10
  python -m experiments.bench_repeat_run --table=/tmp/repeat.json   # its tables again, no runs

Each pair, in fresh directories under --root:
  first   `python -m experiments.train` in a fresh workdir with an empty compilation cache
          (--compile_cache=<pair>/jax) and an empty base store (--config.sft.base_dir=<pair>/bases):
          it compiles every program, mid-trains the base, and leaves both behind;
  repeat  the same command in another fresh workdir: programs come from the cache, the base from
          the store.
Pairs run one after the other (first, repeat, first, repeat, ...), so load changes hit both
sides alike. Each run is a subprocess of this one; within it, JAX's compile events (tracing,
lowering, XLA compilation or a persistent-cache load) are summed, so "compile" is every second
spent producing executables; so is the part of it spent on the main thread, plus the main
thread's waits for a background compile (lowrl.training.precompile): the time the run waits for
compilation (a program compiled ahead on the worker thread overlaps the run and counts in the
first figure only). Reported: both wall times (the subprocess from start to exit, imports
included), repeat / first per pair with the median and range, compilation's share of each run
and of each program (by the jitted function's name, the first run's longest --top), the main
thread's compile wait, the 1-minute load average around each run, and whether the two runs'
metrics.jsonl and final evaluation are identical (they must be: see lowrl.user_cache and
lowrl.training.base_store).

`--xla_stages` also splits each program's XLA compilation (JAX's "xla" seconds) into XLA:CPU's
own timers, read from its log (`TF_CPP_VMODULE=cpu_compiler=1,ir_compiler=1` in the child): the
HLO passes, the backend (emitting kernels and LLVM), and the LLVM compilation of the kernel
modules summed over the threads that ran them (so it can exceed the backend's wall seconds).
"""
from __future__ import annotations

import atexit
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time

_CHILD = "--_child_report"
_COMPILE_EVENTS = ("/jax/core/compile/jaxpr_trace_duration",
                   "/jax/core/compile/jaxpr_to_mlir_module_duration",
                   "/jax/core/compile/backend_compile_duration")
_STAGE = dict(zip(_COMPILE_EVENTS, ("trace", "lower", "xla")))
# XLA:CPU's scoped timers (VLOG 1 of cpu_compiler.cc and ir_compiler.cc), as they read in jaxlib
# 0.10.2: "<label> time: 1.5 s (1500000 us) (cumulative: ...)".
_XLA_LOG_ENV = {"TF_CPP_MIN_LOG_LEVEL": "0", "TF_CPP_VMODULE": "cpu_compiler=1,ir_compiler=1"}
_XLA_TIMER = re.compile(r"(Running HLO passes on \[|Compiling \[|Compiled LLVM module: )"
                        r"(\S*?)\]?(?: for CPU(?: using JIT)?)? time: .*?\((\d+) us\)")
_XLA_START = re.compile(r"Compiling: (\S+)")


def _child(report: str, argv: list[str]) -> None:
  """Runs the training binary in this process, summing JAX's compile events into `report`."""
  from jax import monitoring  # noqa: PLC0415

  try:  # code from before lowrl.training.precompile (measuring a baseline) has no such wait
    from lowrl.training.precompile import WAIT_EVENT as precompile_wait  # noqa: PLC0415
  except ImportError:
    precompile_wait = None

  totals = {e: 0.0 for e in _COMPILE_EVENTS}
  counts = {e: 0 for e in _COMPILE_EVENTS}
  # Compile seconds spent on the main thread: what the run waits for. A compile done on another
  # thread (lowrl.training.precompile) overlaps the run, so it counts in `totals` only.
  main_thread = threading.main_thread()
  main_s = [0.0]
  # Per program (the jitted function's name): seconds of each compile stage, and the count.
  programs: dict[str, dict[str, float]] = {}

  def listen(event: str, duration: float, fun_name: str = "?", **_):
    if event in totals:
      totals[event] += duration
      counts[event] += 1
      on_main = threading.current_thread() is main_thread
      main_s[0] += duration if on_main else 0.0
      row = programs.setdefault(str(fun_name), {"trace": 0.0, "lower": 0.0, "xla": 0.0, "n": 0,
                                                "main": 0.0})
      row[_STAGE[event]] += duration
      row["main"] += duration if on_main else 0.0
      row["n"] += event == _COMPILE_EVENTS[0]
    elif event == precompile_wait:  # the main thread waiting for a background compile
      main_s[0] += duration

  monitoring.register_event_duration_secs_listener(listen)

  def write():
    with open(report, "w") as f:
      json.dump({"compile_s": sum(totals.values()), "main_wait_s": main_s[0], "seconds": totals,
                 "counts": counts, "programs": programs}, f)

  atexit.register(write)
  sys.argv = ["experiments.train", *argv]
  from experiments import train  # noqa: PLC0415 - flags are defined at import

  train.run_main()


def xla_stages(log: str) -> dict[str, dict[str, float]]:
  """Per program (the jit's name, as `_by_program` names it): seconds of XLA:CPU's HLO passes
  ("hlo"), its backend ("backend": kernel emission and LLVM, wall) and the LLVM compilation of its
  kernel modules summed over threads ("llvm"), from a log written under `_XLA_LOG_ENV`. Programs
  compile one at a time on the main thread, so an LLVM module belongs to the program whose
  "Compiling:" line came last."""
  out: dict[str, dict[str, float]] = {}
  current = "?"

  def row(name):
    name = name[4:] if name.startswith("jit_") else name
    return out.setdefault(name, {"hlo": 0.0, "backend": 0.0, "llvm": 0.0})

  for line in log.splitlines():
    if (m := _XLA_START.search(line)) and "time:" not in line:
      current = m.group(1)
    elif m := _XLA_TIMER.search(line):
      kind, name, us = m.group(1), m.group(2), int(m.group(3)) / 1e6
      if kind.startswith("Running"):
        row(name)["hlo"] += us
      elif kind.startswith("Compiling"):
        row(name)["backend"] += us
      else:
        row(current)["llvm"] += us
  return out


def _run(workdir: str, cache: str, store: str, train_flags: list[str],
         stages: bool = False) -> dict:
  """One training subprocess: wall seconds, compile seconds, load before and after (and with
  `stages`, XLA's own compile timers per program: `xla_stages`)."""
  report = workdir + ".compile.json"
  cmd = [sys.executable, "-m", "experiments.bench_repeat_run", _CHILD, report, *train_flags,
         f"--workdir={workdir}", f"--compile_cache={cache}", f"--config.sft.base_dir={store}"]
  load0 = os.getloadavg()[0]
  t0 = time.perf_counter()
  proc = subprocess.run(cmd, cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                        capture_output=True, text=True,
                        env=dict(os.environ, **_XLA_LOG_ENV) if stages else None)
  wall = time.perf_counter() - t0
  if proc.returncode != 0:
    raise SystemExit(f"training run failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
  with open(report) as f:
    compiled = json.load(f)
  with open(os.path.join(workdir, "metrics.jsonl"), "rb") as f:
    metrics = f.read()
  with open(os.path.join(workdir, "summary.json")) as f:
    summary = json.load(f)
  return {"wall_s": wall, "compile_s": compiled["compile_s"], "compile": compiled,
          "main_wait_s": compiled.get("main_wait_s", compiled["compile_s"]),
          "load": (load0, os.getloadavg()[0]), "metrics": metrics,
          "eval_end": summary["eval_end"], "reused_base": "[sft] reusing base" in proc.stdout,
          "xla_stages": xla_stages(proc.stderr) if stages else None}


def _by_program(programs: dict) -> dict:
  """The child's rows merged by program: JAX names the tracing event by the function ("step")
  and lowering and compilation by the jit ("jit(step)")."""
  out: dict[str, dict[str, float]] = {}
  for name, row in programs.items():
    name = name[4:-1] if name.startswith("jit(") and name.endswith(")") else name
    merged = out.setdefault(name, {"trace": 0.0, "lower": 0.0, "xla": 0.0, "n": 0, "main": 0.0})
    for k in merged:
      merged[k] += row.get(k, 0 if k != "main" else sum(row.get(s, 0.0) for s in _STAGE.values()))
  return out


def program_table(row: dict, top: int = 12) -> list[str]:
  """Lines of a table for one pair (a row of --out): the `top` programs by the first run's
  compile seconds (tracing + lowering + XLA compilation or a cache load, summed over the
  program's compiles), each as seconds, count of compiles (traces: a trace-cache hit counts),
  share of its run's wall time and the seconds of it on the main thread, first and repeat run
  side by side; then the rest, the total, and the main thread's compiling plus its waits for a
  background compile (the time the run waited for compilation)."""
  runs = {"first": (_by_program(row["first_compile_parts"]["programs"]), row["first_s"]),
          "repeat": (_by_program(row["repeat_compile_parts"]["programs"]), row["repeat_s"])}

  def parts(run, name):
    p = runs[run][0].get(name, {})
    return (sum(p.get(k, 0.0) for k in ("trace", "lower", "xla")), int(p.get("n", 0)),
            p.get("main", 0.0))

  names = sorted(set(runs["first"][0]) | set(runs["repeat"][0]),
                 key=lambda n: -parts("first", n)[0])
  wf, wr = runs["first"][1], runs["repeat"][1]

  def line(label, a, na, ma, b, nb, mb):
    return (f"{label[:44]:<44} {a:8.1f} {a / wf:6.1%} {na:3d} {ma:7.1f} {b:9.1f} {b / wr:6.1%} "
            f"{nb:3d} {mb:7.1f}")

  # `main`: of those seconds, the main thread's (the rest overlapped the run on another thread).
  lines = [f"{'program':<44} {'first s':>8} {'share':>6} {'n':>3} {'main':>7} {'repeat s':>9} "
           f"{'share':>6} {'n':>3} {'main':>7}"]
  rest, total = [0.0, 0, 0.0] * 2, [0.0, 0, 0.0] * 2
  for i, name in enumerate(names):
    vals = [*parts("first", name), *parts("repeat", name)]
    total = [t + v for t, v in zip(total, vals)]
    if i < top:
      lines.append(line(name, *vals))
    else:
      rest = [r + v for r, v in zip(rest, vals)]
  lines.append(line(f"({max(len(names) - top, 0)} others)", *rest))
  lines.append(line("all compilation", *total))
  # On the main thread only (what the run waited for); older --out files lack it: all of it.
  mf = row.get("first_main_wait_s", total[0])
  mr = row.get("repeat_main_wait_s", total[3])
  lines.append(f"{'main thread: compiling + waiting':<44} {mf:8.1f} {mf / wf:6.1%} "
               f"{'':>11} {mr:9.1f} {mr / wr:6.1%}")
  lines.append(f"{'wall':<44} {wf:8.1f} {'':>6} {'':>3} {wr:9.1f}")
  return lines


def stage_table(row: dict, top: int = 12) -> list[str]:
  """Lines of a table for one pair run with --xla_stages: the first run's `top` programs by
  compile seconds, each split into JAX's tracing and lowering and XLA's compilation, and that
  into XLA:CPU's HLO passes, its backend (wall) and the LLVM compilation of the kernel modules
  (summed over threads); then the same for the repeat run's compiles (cache loads have no XLA
  timers)."""
  lines = [f"{'program (first run)':<30} {'trace':>7} {'lower':>7} {'xla':>7} {'hlo':>7} "
           f"{'backend':>8} {'llvm':>7}   {'repeat: xla':>11} {'hlo':>6} {'backend':>8}"]
  first = _by_program(row["first_compile_parts"]["programs"])
  repeat = _by_program(row["repeat_compile_parts"]["programs"])
  # XLA names a program by its sanitised jit name ("<lambda>" -> "jit__lambda"): match on letters
  # and digits.
  key = lambda name: re.sub(r"[^0-9A-Za-z]", "", name)  # noqa: E731
  sf = {key(n): v for n, v in row["first_xla_stages"].items()}
  sr = {key(n): v for n, v in (row["repeat_xla_stages"] or {}).items()}
  names = sorted(first, key=lambda n: -sum(first[n][k] for k in ("trace", "lower", "xla")))
  total = [0.0] * 9
  for i, name in enumerate(names):
    p, x = first[name], sf.get(key(name), {})
    r, xr = repeat.get(name, {}), sr.get(key(name), {})
    vals = [p["trace"], p["lower"], p["xla"], x.get("hlo", 0.0), x.get("backend", 0.0),
            x.get("llvm", 0.0), r.get("xla", 0.0), xr.get("hlo", 0.0), xr.get("backend", 0.0)]
    total = [t + v for t, v in zip(total, vals)]
    if i < top:
      lines.append(f"{name[:30]:<30} " + " ".join(f"{v:7.1f}" for v in vals[:6]) +
                   f"   {vals[6]:11.1f} {vals[7]:6.1f} {vals[8]:8.1f}")
  lines.append(f"{'all programs':<30} " + " ".join(f"{v:7.1f}" for v in total[:6]) +
               f"   {total[6]:11.1f} {total[7]:6.1f} {total[8]:8.1f}")
  return lines


def _median(xs: list[float]) -> float:
  s = sorted(xs)
  n = len(s)
  return s[n // 2] if n % 2 else (s[n // 2 - 1] + s[n // 2]) / 2


def main(argv):
  del argv
  if _TABLE.value:  # the tables of an earlier run's --out file, nothing run
    with open(_TABLE.value) as f:
      saved = json.load(f)
    for row in saved["pairs"]:
      print(f"[pair {row['pair']}] load {row['load_first']} (first), {row['load_repeat']} (repeat)")
      print("\n".join(program_table(row, _TOP.value)))
      if row.get("first_xla_stages"):
        print("\n".join(stage_table(row, _TOP.value)))
    return
  root = _ROOT.value or tempfile.mkdtemp(prefix="lowrl_repeat_")
  rows = []
  for i in range(_PAIRS.value):
    pair = os.path.join(root, f"pair{i}")
    shutil.rmtree(pair, ignore_errors=True)
    os.makedirs(pair)
    cache, store = os.path.join(pair, "jax"), os.path.join(pair, "bases")
    first = _run(os.path.join(pair, "first"), cache, store, _TRAIN_FLAGS.value, _STAGES.value)
    repeat = _run(os.path.join(pair, "repeat"), cache, store, _TRAIN_FLAGS.value, _STAGES.value)
    row = {"pair": i, "first_s": first["wall_s"], "repeat_s": repeat["wall_s"],
           "ratio": repeat["wall_s"] / first["wall_s"],
           "first_compile_share": first["compile_s"] / first["wall_s"],
           "repeat_compile_share": repeat["compile_s"] / repeat["wall_s"],
           "first_compile_s": first["compile_s"], "repeat_compile_s": repeat["compile_s"],
           "first_main_wait_s": first["main_wait_s"], "repeat_main_wait_s": repeat["main_wait_s"],
           "first_main_wait_share": first["main_wait_s"] / first["wall_s"],
           "repeat_main_wait_share": repeat["main_wait_s"] / repeat["wall_s"],
           "repeat_compile_parts": repeat["compile"], "first_compile_parts": first["compile"],
           "load_first": first["load"], "load_repeat": repeat["load"],
           "repeat_reused_base": repeat["reused_base"],
           "metrics_identical": first["metrics"] == repeat["metrics"],
           "eval_end_identical": first["eval_end"] == repeat["eval_end"],
           "eval_end": repeat["eval_end"],
           "first_xla_stages": first["xla_stages"], "repeat_xla_stages": repeat["xla_stages"]}
    rows.append(row)
    print(f"[pair {i}] first {row['first_s']:.1f}s (compile {row['first_compile_share']:.0%}, "
          f"main thread waiting on it {row['first_main_wait_share']:.0%}, "
          f"load {first['load'][0]:.1f}->{first['load'][1]:.1f}), repeat {row['repeat_s']:.1f}s "
          f"(compile {row['repeat_compile_share']:.0%}, main thread waiting on it "
          f"{row['repeat_main_wait_share']:.0%}, load {repeat['load'][0]:.1f}->"
          f"{repeat['load'][1]:.1f}): repeat/first {row['ratio']:.2f}; base reused "
          f"{row['repeat_reused_base']}, metrics.jsonl identical {row['metrics_identical']}, "
          f"final eval identical {row['eval_end_identical']}", flush=True)
    print("\n".join(program_table(row, _TOP.value)), flush=True)
    if _STAGES.value:
      print("\n".join(stage_table(row, _TOP.value)), flush=True)
  ratios = [r["ratio"] for r in rows]
  shares = [r["repeat_compile_share"] for r in rows]
  print(f"repeat/first: median {_median(ratios):.2f} (range {min(ratios):.2f}-{max(ratios):.2f}, "
        f"{len(rows)} pairs); compilation's share of the repeat run: median "
        f"{_median(shares):.0%} (range {min(shares):.0%}-{max(shares):.0%}); "
        f"{os.cpu_count()} CPU cores; dirs under {root}")
  if _OUT.value:
    with open(_OUT.value, "w") as f:
      json.dump({"pairs": rows, "train_flags": _TRAIN_FLAGS.value,
                 "cpu_count": os.cpu_count()}, f, indent=1)
  if not all(r["metrics_identical"] and r["eval_end_identical"] for r in rows):
    raise SystemExit("a repeat run's metrics differ from its first run's")
  if not _KEEP.value:
    shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
  if len(sys.argv) > 2 and sys.argv[1] == _CHILD:
    _child(sys.argv[2], sys.argv[3:])
  else:
    from absl import app, flags

    _PAIRS = flags.DEFINE_integer("pairs", 1, "Pairs of (first, repeat) runs, one after the other.")
    _ROOT = flags.DEFINE_string("root", "", "Directory for the runs (default: a new temp dir).")
    _KEEP = flags.DEFINE_bool("keep", False, "Keep the runs' directories.")
    _TABLE = flags.DEFINE_string("table", "", "Print the per-program compile tables of this "
                                 "--out file of an earlier run instead of running.")
    _TOP = flags.DEFINE_integer("top", 12, "Programs listed by name in each pair's compile table "
                                "(the first run's longest compiles; the rest summed).")
    _OUT = flags.DEFINE_string("out", "", "Optional JSON file for the per-pair results.")
    _STAGES = flags.DEFINE_bool("xla_stages", False, "Also split each program's XLA compile into "
                                "XLA:CPU's HLO passes, backend and LLVM (its log timers).")
    _TRAIN_FLAGS = flags.DEFINE_list("train_flags", [], "Extra flags of both training runs "
                                     "(comma-separated), e.g. --config.rl.steps=10.")
    app.run(main)
