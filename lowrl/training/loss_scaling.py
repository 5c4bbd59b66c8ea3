"""Static loss scaling for FP16 training: the backward sees cotangents multiplied by `scale`.

FP16's smallest normal is 6.1e-5: the cotangents flowing back through FP16 activations and GEMMs
of a small RL loss underflow to 0 unless the loss is scaled up (Micikevicius et al. 2018, "Mixed
precision training"). `loss_scaled(logprob_fn, scale)` multiplies the cotangent of the FP32
logprobs by `scale` (so everything between them and the parameters runs on scaled values) and
divides the cotangent of the parameters by `scale` again, before the optimizer (and its gradient
clipping) sees it. With `scale` a power of two both multiplications are exact (barring under- or
overflow), so the forward values and, where nothing under/overflows, the gradients are those of
the unscaled program. A scaled gradient that overflows is non-finite: the update's guard skips
that optimizer step (`skipped_updates`), as a dynamic loss scaler would before lowering it.
"""
from __future__ import annotations

import functools
import math
from typing import Any, Callable

import jax


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def scale_cotangent(tree: Any, scale: float) -> Any:
  """Identity on `tree`; its cotangent is multiplied by `scale` on the way back."""
  return tree


def _fwd(tree, scale):
  return tree, None


def _bwd(scale, _, cotangent):
  return (jax.tree.map(lambda g: g * jax.numpy.asarray(scale, g.dtype), cotangent),)


scale_cotangent.defvjp(_fwd, _bwd)


def check_loss_scale(scale: float) -> None:
  """ValueError unless `scale` is a positive power of two (so scaling is exact)."""
  if not (scale > 0 and math.isfinite(scale) and math.frexp(scale)[0] == 0.5):
    raise ValueError(f"--config.optimizer.loss_scale={scale!r}: must be a power of two "
                     "(1 = off; e.g. 1024 for FP16 compute), so that scaling is exact.")


def loss_scaled(logprob_fn: Callable, scale: float) -> Callable:
  """`logprob_fn(params, batch, key) -> (logp_BT, entropy_BT)` with the backward scaled by
  `scale` between the logprobs and the parameters; `logprob_fn` itself when `scale` is 1."""
  check_loss_scale(scale)
  if scale == 1:
    return logprob_fn

  def fn(params, batch, key):
    params = scale_cotangent(params, 1.0 / scale)  # unscale the parameters' gradient
    return scale_cotangent(logprob_fn(params, batch, key), scale)
  return fn
