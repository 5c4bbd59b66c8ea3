r"""One short check of lowrl on one accelerator: init, a GRPO train step, a rollout and the memory
estimate at Qwen3-0.6B's shape (random weights), each part with a hard time budget.

  python -m experiments.gpu_check --out_dir=/tmp/gpu_check                 # Qwen3-0.6B, <= 8 min
  python -m experiments.gpu_check --sizes=qwen3_0_6b,qwen3_1_7b --out_dir=/tmp/gpu_check
  python -m experiments.gpu_check --sizes=tiny --repeats=2 --iters=1 --out_dir=/tmp/t   # CPU
  python -m experiments.gpu_check --dry_run                                 # the plan only

Parts (experiments/gpu_check_parts.py; docs/gpu.md says what each number means):
  init     wall seconds of `init.init_params` (compile + run; then a cached call);
  train    the training loop's RL step (GRPO: forward, backward, AdamW) on a synthetic rollout of
           --sizes' shape, under nvfp4_recipe (emulated) and FP8 (per-tensor E4M3,
           precision.gemm=native), each against the BF16 step interleaved round by round
           (experiments.bench_gemm.compare): median seconds, ratio bf16 / candidate with its
           [min, max] over rounds, MFU (the estimator's model FLOPs over lowrl.hardware's dense
           BF16 rate), compile seconds; and the count of cuBLASLt FP8 GEMM custom calls in the
           native FP8 step's compiled HLO ('n/a' off GPU);
  rollout  the Sampler's prefill + decode under nvfp4_recipe against BF16: new tokens per second;
  memory   the BF16 step once (params and optimizer state donated, as the loop does) in a fresh
           process: `lowrl.memory.estimate`'s per-device figure against
           `device.memory_stats()["peak_bytes_in_use"]` (null where the backend has none, e.g.
           CPU) and XLA's compiled memory analysis.

Each part runs in a process of its own, killed when its budget (--budgets, capped by what is left
of --total_budget_s) runs out: it is then recorded as "timeout" and the next part runs; a part
that fails is recorded as "error" with the end of its output. Writes <out_dir>/gpu_check.json and
<out_dir>/gpu_check.md (one table per size).
"""
from __future__ import annotations

import dataclasses
import importlib.metadata
import json
import os
import subprocess
import sys
import tempfile
import time
from typing import Any

from absl import app, flags

from experiments.gpu_check_parts import PARTS, SHAPES, device_info

DEFAULT_BUDGETS = "init:40,train:200,rollout:150,memory:70"
MAX_TOTAL_S = 480  # the "whole check in at most 8 minutes"
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def parse_budgets(text: str) -> dict[str, float]:
  """"part:seconds,..." -> {part: seconds}, every part named once, with a one-line error."""
  out = {}
  for item in filter(None, text.split(",")):
    name, _, value = item.partition(":")
    try:
      seconds = float(value)
      if not seconds > 0:
        raise ValueError
    except ValueError:
      raise ValueError(f"--budgets entry {item!r}: use part:seconds with seconds > 0, e.g. "
                       "train:210.") from None
    if name not in PARTS:
      raise ValueError(f"--budgets entry {item!r}: unknown part; use {sorted(PARTS)}.")
    out[name] = seconds
  missing = [p for p in PARTS if p not in out]
  if missing:
    raise ValueError(f"--budgets={text!r} has no budget for {missing}; default: "
                     f"{DEFAULT_BUDGETS}.")
  return out


def check_flags(sizes: list[str], parts: list[str], total_budget_s: float, repeats: int,
                iters: int) -> None:
  """One-line errors for bad flags, before anything runs."""
  for s in sizes:
    if s not in SHAPES:
      raise ValueError(f"--sizes entry {s!r}: use one of {sorted(SHAPES)}.")
  for p in parts:
    if p not in PARTS:
      raise ValueError(f"--parts entry {p!r}: use one of {list(PARTS)}.")
  if not 0 < total_budget_s:
    raise ValueError(f"--total_budget_s={total_budget_s} must be > 0 (default {MAX_TOTAL_S}).")
  if repeats < 1 or iters < 1:
    raise ValueError(f"--repeats={repeats} and --iters={iters} must be >= 1.")


def versions() -> dict[str, str | None]:
  out = {}
  for name in ("jax", "jaxlib", "jax-cuda12-plugin", "jax-cuda13-plugin"):
    try:
      out[name] = importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
      out[name] = None
  return out


def run_part(part: str, size: str, budget_s: float, *, repeats: int, iters: int,
             env: dict[str, str] | None = None) -> dict[str, Any]:
  """Runs one part in a child process under `budget_s`: its result, or a timeout / error."""
  with tempfile.TemporaryDirectory() as tmp:
    path = os.path.join(tmp, "part.json")
    cmd = [sys.executable, "-m", "experiments.gpu_check", f"--part={part}", f"--sizes={size}",
           f"--part_out={path}", f"--repeats={repeats}", f"--iters={iters}"]
    t0 = time.perf_counter()
    try:
      proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True,
                            timeout=budget_s)
    except subprocess.TimeoutExpired:
      # What the part had finished (it writes its result after each comparison).
      partial = _read(path)
      return {"status": "timeout", "budget_s": budget_s, "wall_s": time.perf_counter() - t0,
              **({"partial": partial} if partial else {})}
    wall = time.perf_counter() - t0
    if proc.returncode != 0 or not os.path.exists(path):
      partial = _read(path)
      return {"status": "error", "budget_s": budget_s, "wall_s": wall,
              "returncode": proc.returncode, "output_tail": (proc.stdout + proc.stderr)[-2000:],
              **({"partial": partial} if partial else {})}
    result = _read(path)
  return {"status": "ok", "budget_s": budget_s, "wall_s": wall, **result}


def _read(path: str) -> dict[str, Any] | None:
  try:
    with open(path) as f:
      return json.load(f)
  except (OSError, ValueError):
    return None


def run(*, sizes: list[str], parts: list[str], budgets: dict[str, float], total_budget_s: float,
        repeats: int, iters: int, env: dict[str, str] | None = None) -> dict[str, Any]:
  """Every part of every size in order, each in its own process within the budgets."""
  check_flags(sizes, parts, total_budget_s, repeats, iters)
  start = time.perf_counter()
  report = {"versions": versions(), "total_budget_s": total_budget_s, "repeats": repeats,
            "iters": iters, "sizes": {}}
  for size in sizes:
    report["sizes"][size] = {"shape": dataclasses.asdict(SHAPES[size]), "parts": {}}
    for part in parts:
      left = total_budget_s - (time.perf_counter() - start)
      if left <= 0:
        result = {"status": "skipped", "reason": "total budget spent"}
      else:
        result = run_part(part, size, min(budgets[part], left), repeats=repeats, iters=iters,
                          env=env)
      report["sizes"][size]["parts"][part] = result
      print(f"[gpu_check] {size} {part}: {result['status']} "
            f"({result.get('wall_s', 0):.0f} s)", flush=True)
  report["wall_s"] = time.perf_counter() - start
  return report


def _fmt(x, spec: str = ".3g", scale: float = 1.0) -> str:
  return "null" if x is None else format(x * scale, spec)


def _bytes(x: int | None) -> str:
  if x is None:
    return "null"
  return f"{x / 1e9:.4g} GB" if x >= 1e8 else f"{x / 1e6:.4g} MB"


def _part_rows(part: str, r: dict[str, Any]) -> list[str]:
  """Table rows of what a part measured (all of it, or what it finished before its budget)."""
  rows = []
  if part == "init" and "first_call_s" in r:
    rows.append(f"| init | init_params, {r['num_params']:,} params | first call "
                f"{r['first_call_s']:.2f} s (compile + run), second {r['second_call_s']:.3f} s "
                "| | | | |")
  for name, c in r.get("candidates", {}).items():
    if part == "train":
      value, base = f"{c['candidate_s'] * 1e3:.4g} ms/step", f"{c['baseline_s'] * 1e3:.4g} ms"
      mfu = f"{_fmt(c['mfu'], '.1%')} / {_fmt(c['baseline_mfu'], '.1%')}"
      comp = f"{c['compile_s']:.1f}"
    else:
      value = f"{c['tokens_per_s']:.4g} tok/s"
      base, mfu = f"{c['baseline_tokens_per_s']:.4g} tok/s", ""
      comp = f"{c['first_call_s']:.1f} (first call)"
    rows.append(f"| {part} | {name} | {value} | {base} | {c['ratio']:.2f} "
                f"[{c['ratio_min']:.2f}, {c['ratio_max']:.2f}] | {mfu} | {comp} |")
    if "fp8_gemm_calls" in c:
      rows.append(f"| train | {name} HLO: cuBLASLt FP8 GEMM calls | {c['fp8_gemm_calls']} "
                  f"(found: {c['fp8_gemm_found']}; cuBLASLt {c['cublaslt_calls']}, cuBLAS "
                  f"{c['cublas_gemm_calls']}, f8e4m3fn {c['f8e4m3fn_mentions']}) | | | | |")
  if part == "memory" and "estimate_bytes" in r:
    rows.append(f"| memory | bf16 step, donated | estimate {_bytes(r['estimate_bytes'])}, peak "
                f"{_bytes(r['peak_bytes'])} (peak / estimate "
                f"{_fmt(r['peak_over_estimate'], '.2f')}), XLA analysis "
                f"{_bytes(r['xla_memory_analysis_bytes'])} | | | | |")
  return rows


def markdown(report: dict[str, Any]) -> str:
  """One table per size: what each part measured (docs/gpu.md explains every column)."""
  lines = []
  for size, entry in report["sizes"].items():
    parts = entry["parts"]
    device = next((r.get("device") or r.get("partial", {}).get("device") for r in parts.values()
                   if r.get("device") or r.get("partial")), None) or {}
    lines += [f"### {size} on {device.get('device_kind', '?')} ({device.get('platform', '?')})",
              "", "| part | setting | value | bf16 baseline | bf16 / candidate [min, max] | "
              "MFU (cand / bf16) | compile s |", "|---|---|---|---|---|---|---|"]
    for part, r in parts.items():
      if r["status"] != "ok":
        lines.append(f"| {part} | | **{r['status']}** (budget {_fmt(r.get('budget_s'), '.0f')} s"
                     + ("; finished rows below" if r.get("partial") else "") + ") | | | | |")
      lines += _part_rows(part, r if r["status"] == "ok" else r.get("partial") or {})
    lines.append("")
  v = report["versions"]
  lines.append("versions: " + ", ".join(f"{k} {x}" for k, x in v.items() if x) +
               f"; {report['repeats']} rounds x {report['iters']} calls per comparison; "
               f"wall {report['wall_s']:.0f} s of a {report['total_budget_s']:.0f} s budget.")
  return "\n".join(lines)


def write(report: dict[str, Any], out_dir: str) -> tuple[str, str]:
  """<out_dir>/gpu_check.json and gpu_check.md; returns their paths."""
  os.makedirs(out_dir, exist_ok=True)
  paths = os.path.join(out_dir, "gpu_check.json"), os.path.join(out_dir, "gpu_check.md")
  with open(paths[0], "w") as f:
    json.dump(report, f, indent=1)
  with open(paths[1], "w") as f:
    f.write(markdown(report) + "\n")
  return paths


def run_child(part: str, size: str, out_path: str, *, repeats: int, iters: int) -> None:
  """In the part's own process: runs it and writes its JSON (with the device it ran on)."""
  device = device_info()

  def emit(result: dict[str, Any]) -> None:  # atomic: a kill mid-write leaves the last one
    with open(out_path + ".tmp", "w") as f:
      json.dump({"device": device, **result}, f)
    os.replace(out_path + ".tmp", out_path)

  emit(PARTS[part](SHAPES[size], emit, repeats=repeats, iters=iters))


def dry_run(sizes: list[str], parts: list[str], budgets: dict[str, float],
            total_budget_s: float) -> str:
  """The plan: shapes, parts and budgets (nothing is compiled)."""
  lines = [f"total budget {total_budget_s:.0f} s; parts {parts} with budgets "
           f"{ {p: budgets[p] for p in parts} }"]
  for s in sizes:
    lines.append(f"{s}: {SHAPES[s]}")
  return "\n".join(lines)


def main(argv):
  del argv
  sizes, parts = _SIZES.value, _PARTS.value
  if _PART.value:
    run_child(_PART.value, sizes[0], _PART_OUT.value, repeats=_REPEATS.value, iters=_ITERS.value)
    return 0
  try:
    budgets = parse_budgets(_BUDGETS.value)
    check_flags(sizes, parts, _TOTAL.value, _REPEATS.value, _ITERS.value)
  except ValueError as e:  # a bad flag: one line (nothing runs yet, no thread to wait for)
    print(f"error: {e}", file=sys.stderr, flush=True)
    return 2
  if _DRY_RUN.value:
    print(dry_run(sizes, parts, budgets, _TOTAL.value))
    return 0
  report = run(sizes=sizes, parts=parts, budgets=budgets, total_budget_s=_TOTAL.value,
               repeats=_REPEATS.value, iters=_ITERS.value)
  paths = write(report, _OUT_DIR.value)
  print(markdown(report))
  print(f"wrote {paths[0]} and {paths[1]}")
  return 0


if __name__ == "__main__":
  # Flags only when run as a binary: the tests import several experiments (one absl flag registry).
  _SIZES = flags.DEFINE_list("sizes", ["qwen3_0_6b"], f"Shapes to check, in order: {sorted(SHAPES)}"
                             " (tiny: the CPU test's).")
  _PARTS = flags.DEFINE_list("parts", list(PARTS), "Parts to run, in order.")
  _BUDGETS = flags.DEFINE_string("budgets", DEFAULT_BUDGETS, "Seconds per part (its process is "
                                 "killed after that: recorded as timeout).")
  _TOTAL = flags.DEFINE_float("total_budget_s", MAX_TOTAL_S, "Seconds for the whole check; a part "
                              "gets at most what is left.")
  _REPEATS = flags.DEFINE_integer("repeats", 5, "Interleaved timed rounds per comparison.")
  _ITERS = flags.DEFINE_integer("iters", 2, "Calls per timed round.")
  _OUT_DIR = flags.DEFINE_string("out_dir", "/tmp/gpu_check", "Where gpu_check.json/.md go.")
  _DRY_RUN = flags.DEFINE_bool("dry_run", False, "Print the plan and exit (nothing runs).")
  _PART = flags.DEFINE_string("part", "", "Internal: run this one part (in a child process).")
  _PART_OUT = flags.DEFINE_string("part_out", "", "Internal: the child's JSON output path.")
  app.run(main)
