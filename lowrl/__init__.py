"""lowrl: low-precision policy-gradient RL for language models in JAX."""
import os as _os

# BF16/FP16 results must not depend on how XLA happens to fuse a program. With excess precision
# allowed (XLA's default), a fused chain of BF16 ops is evaluated in FP32 and rounded once, so the
# same forward compiled into two programs (the sampler's scoring and the trainer's loss) rounds
# differently; NVFP4 then turns a one-ulp difference into a different code, and a PPO ratio that
# should be exactly 1 came out 1.10 on average (tests/training/test_training.py). Rounding at every op makes
# "bf16" mean bf16 everywhere. Read when the backend starts, so setting it at import is in time.
# Opt out with LOWRL_ALLOW_EXCESS_PRECISION=1.
_FLAG = "--xla_allow_excess_precision=false"
if (_os.environ.get("LOWRL_ALLOW_EXCESS_PRECISION") != "1"
    and "xla_allow_excess_precision" not in _os.environ.get("XLA_FLAGS", "")):
  _os.environ["XLA_FLAGS"] = (_os.environ.get("XLA_FLAGS", "") + " " + _FLAG).strip()
