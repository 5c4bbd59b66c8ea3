"""Adaptive quantization noise (AQN; QeRL, Huang et al., arXiv 2510.11696, section 3.3): Gaussian
noise of a scheduled, decaying scale added to the RMSNorm weights of a LoRA run's frozen base.

QeRL reads the noise a quantized base adds as extra exploration (higher policy entropy) and adds
more of it on purpose: a channel-wise vector Z ~ N(0, sigma^2) merged into each RMSNorm weight
(w + Z), which scales the input channels of the linears that follow the norm, with no extra
parameters or kernels. The scale follows QeRL's staged schedule (NVlabs/QeRL's noise scheduler,
`get_sigma_by_step`): the run's steps are cut into `stages` equal intervals; the first runs
without noise; interval k >= 1 uses sigma_k = sigma_start * (sigma_end / sigma_start) ** ((k - 1)
/ (stages - 2)), a geometric (exponential) decay from sigma_start to sigma_end over the other
stages - 1 intervals (one interval of sigma_start when stages = 2). QeRL's code takes the list of
sigmas as an input; the geometric list is the paper's exponential scheduler (its text gives
sigma_start, sigma_end and the number of stages).

Here the noise is a pure function of (seed, step): drawn afresh at every step with that step's
sigma, added to the norms the step's sampler and update both see (exact mode stays exact: one
noisy forward on both sides), and taken out again after the update, so the state's base stays
the clean frozen one and evaluation runs without noise. Which norms: the pre-attention and
pre-MLP RMSNorms and the final norm (Qwen2 / Llama `RMSNorm` modules, what QeRL's code perturbs;
Qwen3's per-head q/k norms are left alone).
"""
from __future__ import annotations

import dataclasses
import re
import zlib
from typing import Any

import jax
import jax.numpy as jnp

# The RMSNorm weights AQN perturbs (full paths of `scale` leaves in the param tree).
NORMS = r"(layers_\d+/(attn|mlp)_norm|final_norm)/scale"
_STREAM = 0xA9  # fold_in of the run's seed key for the noise


@dataclasses.dataclass(frozen=True)
class AqnConfig:
  """The schedule (module docstring): sigma from sigma_start down to sigma_end over `stages`
  intervals of the run, the first without noise (`check` says what is valid)."""

  sigma_start: float
  sigma_end: float
  stages: int


def config_from(section: Any) -> AqnConfig | None:
  """The AqnConfig of a `lora` config section; None when lora.aqn_sigma_start is 0 (off)."""
  start = float(section.get("aqn_sigma_start", 0.0))
  if not start:
    return None
  return AqnConfig(start, float(section.get("aqn_sigma_end", 0.0)),
                   int(section.get("aqn_stages", 0)))


def check(cfg: AqnConfig) -> None:
  """One-line errors naming the flag."""
  if not cfg.sigma_start > 0:
    raise ValueError(f"--config.lora.aqn_sigma_start={cfg.sigma_start}: must be > 0 (0 = AQN "
                     "off).")
  if not 0 < cfg.sigma_end <= cfg.sigma_start:
    raise ValueError(f"--config.lora.aqn_sigma_end={cfg.sigma_end}: must be in (0, "
                     f"aqn_sigma_start={cfg.sigma_start}] (the schedule decays geometrically).")
  if cfg.stages < 2:
    raise ValueError(f"--config.lora.aqn_stages={cfg.stages}: must be >= 2 (the first stage "
                     "runs without noise).")


def sigma(cfg: AqnConfig, step: int, total_steps: int) -> float:
  """The noise scale of `step` (0-based) in a run of `total_steps` (module docstring)."""
  n_sigmas = cfg.stages - 1
  stage = int(min(step, total_steps) // (total_steps / cfg.stages))
  if stage == 0:
    return 0.0
  k = min(stage - 1, n_sigmas - 1)
  exponent = k / (n_sigmas - 1) if n_sigmas > 1 else 0.0
  return cfg.sigma_start * (cfg.sigma_end / cfg.sigma_start) ** exponent


def _is_norm(path) -> bool:
  return re.fullmatch(NORMS, jax.tree_util.keystr(path, simple=True, separator="/")) is not None


def perturb(params: Any, scale: float, seed: int, step: int) -> Any:
  """`params` with N(0, scale^2) noise (FP32, drawn from (seed, step, path)) added to each AQN
  norm weight; every other leaf as it is (the same buffers)."""
  if not scale:
    return params
  key = jax.random.fold_in(jax.random.fold_in(jax.random.key(seed), _STREAM), step)

  def one(path, x):
    if not _is_norm(path):
      return x
    k = jax.random.fold_in(key, zlib.crc32(jax.tree_util.keystr(path).encode()) % (2 ** 31))
    return (x.astype(jnp.float32) + scale * jax.random.normal(k, x.shape)).astype(x.dtype)

  return jax.tree_util.tree_map_with_path(one, params)


def restore(noisy: Any, clean: Any) -> Any:
  """`noisy` with its AQN norm weights taken from `clean` (the other leaves from `noisy`)."""
  return jax.tree_util.tree_map_with_path(lambda p, n, c: c if _is_norm(p) else n, noisy, clean)
