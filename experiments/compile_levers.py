r"""Compile seconds of the main job's largest programs under XLA:CPU compile options, and whether
an option leaves the programs' machine code unchanged.

  python -m experiments.compile_levers capture /tmp/levers [train flags]   # the main job, once
  python -m experiments.compile_levers --dir=/tmp/levers --programs=4 \
      --levers="base:;split1:xla_cpu_parallel_codegen_split_count=1" --rounds=2 --check

`capture DIR` runs the training binary (`experiments.train`, the README's main job unless train
flags say otherwise) in this process with an empty compilation cache and base store under DIR
and saves every program whose XLA compilation took at least 1 s (StableHLO bytecode and the
compile options JAX passed), named by the jit and numbered in compile order.

Then, in one process, each of the `--programs` longest saved programs is compiled again once per
lever and round (`backend.compile_and_load`, the call JAX makes; no persistent cache): a lever is
`name:option=value,option=value` over XLA's debug options, added to the program's own options
the way `jax.jit(...).lower(...).compile(compiler_options=...)` adds them (`base:` adds none; every
compile also gets the process's XLA_FLAGS as lowrl sets them: `LOWRL_XLA_FAST_COMPILE=1` for
lowrl's opt-in compile preset as base).
The levers' order rotates by one per program and round, so load changes hit every lever alike.
Reported per program and lever: wall and CPU seconds (this process's user + system, all of XLA's
threads) per compile, median over rounds, and each lever over `base` (ratios of medians).

`--check` compiles each program once more per lever with `xla_dump_to` and compares the object
files XLA:CPU emitted for its kernels with base's, and the optimized HLO: "same code" means every
kernel's machine code is byte for byte base's, so the lever cannot change a result on any CPU that
runs base's code; "differs" counts the kernel objects that differ (then results may differ
somewhere, even if the main job's are unchanged here).
"""
from __future__ import annotations

import contextlib
import filecmp
import json
import os
import resource
import shutil
import statistics
import sys
import time
from collections.abc import Iterator

_MIN_S = 1.0


@contextlib.contextmanager
def capturing(out: str, min_s: float = _MIN_S) -> Iterator[list[dict]]:
  """Within the block, every program whose XLA compilation takes >= `min_s` is saved under `out`
  (listed in out/programs.json and in the yielded list, which grows)."""
  from jax._src import compiler  # noqa: PLC0415
  from jax._src.interpreters import mlir  # noqa: PLC0415

  os.makedirs(out, exist_ok=True)
  original = compiler.backend_compile_and_load
  saved = []

  def compile_and_save(backend, module, executable_devices, options, host_callbacks):
    t0 = time.perf_counter()
    exe = original(backend, module, executable_devices, options, host_callbacks)
    seconds = time.perf_counter() - t0
    if seconds >= min_s and not host_callbacks:
      name = str(module.operation.attributes["sym_name"]).strip('"')
      stem = os.path.join(out, f"{len(saved):03d}_{name}")
      with open(stem + ".mlirbc", "wb") as f:
        f.write(mlir.module_to_bytecode(module))
      with open(stem + ".options", "wb") as f:
        f.write(options.SerializeAsString())
      saved.append({"stem": os.path.basename(stem), "name": name, "seconds": seconds,
                    "devices": [d.id for d in executable_devices]})
      with open(os.path.join(out, "programs.json"), "w") as f:
        json.dump(saved, f, indent=1)
    return exe

  compiler.backend_compile_and_load = compile_and_save
  try:
    yield saved
  finally:
    compiler.backend_compile_and_load = original


def _capture(out: str, argv: list[str]) -> None:
  """Runs the training binary in this process, saving the programs that took >= _MIN_S to XLA."""
  sys.argv = ["experiments.train", *argv, f"--workdir={os.path.join(out, 'work')}",
              f"--compile_cache={os.path.join(out, 'jax')}",
              f"--config.sft.base_dir={os.path.join(out, 'bases')}"]
  from experiments import train  # noqa: PLC0415 - flags are defined at import

  with capturing(out):
    train.run_main()


def _value(text: str):
  """An option's value as XLA's debug options take it: bool, int, float or string."""
  if text in ("true", "false"):
    return text == "true"
  for kind in (int, float):
    try:
      return kind(text)
    except ValueError:
      pass
  return text


def parse_levers(spec: str) -> dict[str, list[tuple[str, object]]]:
  """`name:opt=v,opt=v;name:...` -> {name: [(opt, value), ...]}; `base` (no options) first."""
  levers: dict[str, list[tuple[str, object]]] = {}
  for part in filter(None, (p.strip() for p in spec.split(";"))):
    name, _, opts = part.partition(":")
    levers[name] = [(k, _value(v)) for k, _, v in
                    (o.partition("=") for o in filter(None, opts.split(",")))]
  if "base" not in levers:
    levers = {"base": [], **levers}
  return levers


def compile_saved(backend, program: dict, directory: str, extra: list[tuple[str, object]]):
  """(wall s, CPU s) of one compile of a saved program with `extra` debug options."""
  from jax._src.lib import xla_client as xc  # noqa: PLC0415

  with open(os.path.join(directory, program["stem"] + ".mlirbc"), "rb") as f:
    module = f.read()
  with open(os.path.join(directory, program["stem"] + ".options"), "rb") as f:
    options = xc.CompileOptions.ParseFromString(f.read())
  options.env_option_overrides = [*options.env_option_overrides, *extra]
  by_id = {d.id: d for d in backend.devices()}
  devices = xc.DeviceList(tuple(by_id[i] for i in program["devices"]))
  r0, t0 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
  exe = backend.compile_and_load(module, executable_devices=devices, compile_options=options)
  wall, r1 = time.perf_counter() - t0, resource.getrusage(resource.RUSAGE_SELF)
  del exe
  return wall, (r1.ru_utime - r0.ru_utime) + (r1.ru_stime - r0.ru_stime)


def _objects(dump: str) -> dict[str, str]:
  """The kernel object files of one dumped compile, by name without the module number."""
  return {name.split(".", 1)[1]: os.path.join(dump, name) for name in os.listdir(dump)
          if name.endswith(".o")}


def _optimized_hlo(dump: str) -> str:
  """The optimized HLO text of one dumped compile."""
  (name,) = [n for n in os.listdir(dump) if n.endswith(".cpu_after_optimizations.txt")]
  with open(os.path.join(dump, name)) as f:
    return f.read()


def same_code(base_dump: str, other_dump: str) -> tuple[int, int, bool]:
  """(kernel objects that differ from base's or exist on one side only, base's kernel count,
  whether the optimized HLO is base's too)."""
  a, b = _objects(base_dump), _objects(other_dump)
  differ = sum(1 for k in a.keys() | b.keys()
               if k not in a or k not in b or not filecmp.cmp(a[k], b[k], shallow=False))
  return differ, len(a), _optimized_hlo(base_dump) == _optimized_hlo(other_dump)


def check(backend, program: dict, directory: str,
          levers: dict[str, list[tuple[str, object]]]) -> dict[str, tuple[int, int, bool]]:
  """Compiles a saved program once per lever with its kernels dumped (under
  directory/check/<program>/<lever>) and compares each lever's with `base`'s: `same_code` per
  lever other than base."""
  dumps = {}
  for lever, extra in levers.items():
    dumps[lever] = os.path.join(directory, "check", program["stem"], lever)
    shutil.rmtree(dumps[lever], ignore_errors=True)
    compile_saved(backend, program, directory, [*extra, ("xla_dump_to", dumps[lever])])
  return {lever: same_code(dumps["base"], dumps[lever]) for lever in levers if lever != "base"}


def main(argv):
  del argv
  import jax  # noqa: PLC0415

  import lowrl  # noqa: F401, PLC0415 - XLA_FLAGS as the binaries set them

  backend = jax.devices("cpu")[0].client
  with open(os.path.join(_DIR.value, "programs.json")) as f:
    programs = sorted(json.load(f), key=lambda p: -p["seconds"])[:_PROGRAMS.value]
  levers = parse_levers(_LEVERS.value)
  names = list(levers)
  print(f"XLA_FLAGS {os.environ.get('XLA_FLAGS')}; levers {levers}; load "
        f"{os.getloadavg()[0]:.1f}", flush=True)
  times: dict[tuple[str, str], list[tuple[float, float]]] = {}
  for r in range(_ROUNDS.value):
    for i, p in enumerate(programs):
      k = (r + i) % len(names)
      for lever in names[k:] + names[:k]:
        wall, cpu = compile_saved(backend, p, _DIR.value, levers[lever])
        times.setdefault((p["stem"], lever), []).append((wall, cpu))
        print(f"round {r} {p['stem']:<28} {lever:<10} wall {wall:7.1f} s  cpu {cpu:7.1f} s  "
              f"load {os.getloadavg()[0]:.1f}", flush=True)
  print(f"\n{'program':<28} {'lever':<10} {'wall s':>7} {'cpu s':>7} {'wall/base':>9} "
        f"{'cpu/base':>8} {'range wall/base':>15}")
  report = {}
  for p in programs:
    base = times[(p["stem"], "base")]
    bw, bc = (statistics.median(x[i] for x in base) for i in (0, 1))
    for lever in names:
      t = times[(p["stem"], lever)]
      w, c = (statistics.median(x[i] for x in t) for i in (0, 1))
      per_round = [x[0] / y[0] for x, y in zip(t, base)]
      report[f"{p['stem']}/{lever}"] = {"wall": w, "cpu": c, "wall_ratios": per_round}
      print(f"{p['stem']:<28} {lever:<10} {w:7.1f} {c:7.1f} {w / bw:9.3f} {c / bc:8.3f} "
            f"{min(per_round):7.3f}-{max(per_round):.3f}")
  if _CHECK.value:
    for p in programs:
      for lever, (differ, n, hlo) in check(backend, p, _DIR.value, levers).items():
        report[f"{p['stem']}/{lever}"].update(objects_differ=differ, objects=n, same_hlo=hlo)
        print(f"{p['stem']:<28} {lever:<10} " +
              ("same code" if differ == 0 else f"differs: {differ} of {n} kernel objects") +
              f"; optimized HLO {'the same' if hlo else 'differs'}", flush=True)
  if _OUT.value:
    with open(_OUT.value, "w") as f:
      json.dump({"levers": {k: [list(o) for o in v] for k, v in levers.items()},
                 "rounds": _ROUNDS.value, "report": report}, f, indent=1)


if __name__ == "__main__":
  if len(sys.argv) > 2 and sys.argv[1] == "capture":
    _capture(sys.argv[2], sys.argv[3:])
  else:
    from absl import app, flags

    _DIR = flags.DEFINE_string("dir", None, "A `capture` directory.", required=True)
    _PROGRAMS = flags.DEFINE_integer("programs", 4, "The longest saved programs to compile.")
    _LEVERS = flags.DEFINE_string("levers", "base:", "`name:option=value,...;name:...` levers "
                                  "(XLA debug options); `base` (none) is added if missing.")
    _ROUNDS = flags.DEFINE_integer("rounds", 1, "Rounds (every program under every lever).")
    _CHECK = flags.DEFINE_bool("check", False, "Compare each lever's kernel object files with "
                               "base's (one more compile each, dumped).")
    _OUT = flags.DEFINE_string("out", "", "Optional JSON file for the results.")
    app.run(main)
