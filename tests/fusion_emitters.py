"""The test processes compile with XLA:CPU's elemental IR emitter for fusions instead of its MLIR
fusion emitters, except programs that hold a sub-byte type, which that emitter cannot lower.

Why: on the tiny shape's BF16, NVFP4 and native-FP8 GRPO steps and its BF16 and NVFP4 samplers
the elemental emitter took 54% less compile CPU (42 -> 19 s; compiling is most of the suite's CPU
time, the programs run in milliseconds). Their outputs were bit for bit those of the fusion
emitters; two simulated runs (nvfp4_naive and nvfp4_recipe samplers against BF16, 8 steps, 2
seeds) gave the same rewards, and FP32 metrics within 2.4e-7 relative (1-2 ulp: the emitters
order reductions and expand exp/log differently), as LLVM level 0 does (multiprocess.py): no
test may depend on it, a bit-for-bit comparison is only ever between identical programs, and
tolerances come from stated bounds. It cannot lower a bitcast to 4-bit elements ("Invalid LLVM IR ... bitcast i8 to i4",
e.g. `sampling.pack_params`' FP4 codes), so a program with a sub-byte element type keeps the
fusion emitters, as in production. The choice is made per program from its text before the
persistent cache is asked, so the cache key holds it (a cached executable is always the one the
key's options build).

Set per program rather than in XLA_FLAGS (where it would apply to every program, those with
4-bit types too): `install()` in each test worker (conftest.py) and, through `child_env()`, in the
processes the tests launch. LOWRL_TEST_FUSION_EMITTERS=1 turns it off (every program with the
fusion emitters, as in production).
"""
from __future__ import annotations

import os
import re

# MLIR element types narrower than a byte (i1 is a bool, lowered as a byte).
_SUB_BYTE = re.compile(r"[x<](?:u?i[24]|f4E2M1FN|f6E2M3FN|f6E3M2FN)[>,]")
_OPTION = ("xla_cpu_use_fusion_emitters", False)
# The variable that makes a launched Python process install it (tests/launched/sitecustomize.py).
ENV = "LOWRL_TEST_ELEMENTAL_EMITTER"
_SITE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "launched")


def install() -> None:
  """Compiles every CPU program without a sub-byte type with the elemental emitter (idempotent)."""
  from jax._src import compiler  # noqa: PLC0415 - after conftest set XLA_FLAGS

  if os.environ.get("LOWRL_TEST_FUSION_EMITTERS") == "1" or getattr(compiler.compile_or_get_cached, "_elemental_emitter", False):
    return
  original = compiler.compile_or_get_cached

  def compile_or_get_cached(backend, computation, devices, compile_options, *args, **kwargs):
    if backend.platform == "cpu" and not _SUB_BYTE.search(
        computation.operation.get_asm(large_elements_limit=16)):
      compile_options.env_option_overrides = [*compile_options.env_option_overrides, _OPTION]
    return original(backend, computation, devices, compile_options, *args, **kwargs)

  compile_or_get_cached._elemental_emitter = True  # noqa: SLF001
  compiler.compile_or_get_cached = compile_or_get_cached


def child_env(env: dict[str, str]) -> dict[str, str]:
  """`env` for a launched Python process that compiles as the test workers do."""
  path = env.get("PYTHONPATH", "")
  return dict(env, **{ENV: "1", "PYTHONPATH": _SITE + (os.pathsep + path if path else "")})
