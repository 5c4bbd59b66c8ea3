"""lowrl: low-precision policy-gradient RL for language models in JAX."""
import os as _os
import platform as _platform

# XLA flags set at import (read when the backend starts, so importing lowrl first is in time); a
# flag XLA_FLAGS already names is left as the user set it. docs/numerics.md says why each is there.
#
# BF16/FP16 results must not depend on how XLA happens to fuse a program. With excess precision
# allowed (XLA's default), a fused chain of BF16 ops is evaluated in FP32 and rounded once, so the
# same forward compiled into two programs (the sampler's scoring and the trainer's loss) rounds
# differently; NVFP4 then turns a one-ulp difference into a different code, and a PPO ratio that
# should be exactly 1 came out 1.10 on average (tests/training/test_training.py). Rounding at every op makes
# "bf16" mean bf16 everywhere. Opt out with LOWRL_ALLOW_EXCESS_PRECISION=1.
_EXCESS_PRECISION = ("xla_allow_excess_precision", "false")
# Results must not depend on which x86 CPU runs them. XLA:CPU hands every dot to YNNPACK, which
# picks its kernels (and their summation order) from the host's instruction set at run time; the
# first flag makes it keep to kernels that give the same bits on every CPU one jaxlib build runs
# on (YNN_FLAG_CONSISTENT_ARITHMETIC), and XLA's own codegen to CPU-independent math (rsqrt). The
# second caps XLA's code generation at AVX2 (+FMA), which every x86 CPU of the last decade has:
# on this AVX-512 host the main job's base eval read 0.481 uncapped and 0.482 capped, as another
# machine gave. Opt out with LOWRL_CPU_PLATFORM_MATH=1 (numbers then move with the CPU).
CROSS_CPU_FLAGS = (("xla_cpu_enable_platform_dependent_math", "false"),) + (
    (("xla_cpu_max_isa", "AVX2"),) if _platform.machine().lower() in ("x86_64", "amd64") else ())
# Compile time (issue 46): XLA:CPU's FAST_COMPILE preset runs a shorter HLO pass pipeline (the
# main job's HLO passes 61 -> 12 s, its XLA compiling 170 -> 125 s at load 5) and fuses
# differently, so the kernels' machine code is not the default preset's. What was checked: the
# README main job's metrics.jsonl is byte-identical with it (md5 1fe4a454...) and the cross-CPU
# probe (tests/cpu_probe.py: a train step, forward and backward, and two GEMMs) gives the same
# bits under every recipe; it adds no host dependence (the pins above still apply to its code).
# Not proven: that every other program gives the default preset's bits, so it is opt-in
# (LOWRL_XLA_FAST_COMPILE=1) until the whole suite has passed with it on. docs/benchmarks.md
# "Where a first run's compile time goes".
COMPILE_FLAGS = (("xla_cpu_opt_preset", "CPU_OPT_PRESET_FAST_COMPILE"),)


def _flags() -> tuple[tuple[str, str], ...]:
  out = ()
  if _os.environ.get("LOWRL_ALLOW_EXCESS_PRECISION") != "1":
    out += (_EXCESS_PRECISION,)
  if _os.environ.get("LOWRL_CPU_PLATFORM_MATH") != "1":
    out += CROSS_CPU_FLAGS
  if _os.environ.get("LOWRL_XLA_FAST_COMPILE") == "1":
    out += COMPILE_FLAGS
  return out


for _name, _value in _flags():
  if _name not in _os.environ.get("XLA_FLAGS", ""):
    _os.environ["XLA_FLAGS"] = (_os.environ.get("XLA_FLAGS", "") + f" --{_name}={_value}").strip()
del _name, _value
