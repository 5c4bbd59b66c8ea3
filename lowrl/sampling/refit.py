"""Rollout weights held by a sampler between weight syncs, and the refit check.

At a weight sync the sampler gets the trainer's new weights as `RolloutWeights`: the kernels
quantized and packed once (`weights.pack_params`: codes, block and per-tensor scales), the static
amaxes calibrated on those weights (`act_amax`: a tensor-scaled recipe's activation scales and a
quantized KV cache's K/V scales, which `act_scales.calibration_paths` calibrates together), and a
slot for calibration kept apart from them (`kv_scales`, None unless filled). The refit check
(peer frameworks' most reported bug: stale scales after a weight update) compares every tensor
the sampler holds with a fresh quantization and calibration of the trainer's weights, bit for
bit: the fresh quantization and calibration run the programs a sync runs (compiled once for
both), the comparison a small jitted program; only one boolean per tensor leaves the device.
A mismatch count of 0 is the expected value.
"""
from __future__ import annotations

from typing import Any, Callable, Mapping, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from lowrl.models.config import ModelConfig
from lowrl.precision import PrecisionPolicy
from lowrl.sampling import weights

Params = Any


class RolloutWeights(NamedTuple):
  """What a sampler holds between syncs (a pytree).

  Attributes:
    weights: a `pack_params` tree (quantized kernels packed, the rest as the trainer's), or the
      trainer's tree itself when the recipe's weight quantizers round stochastically (re-drawn
      every forward, so nothing can be held quantized).
    act_amax: static activation amaxes ({full path: FP32 scalar}) or None.
    kv_scales: quantized-KV-cache calibration ({name: array}) or None; compared like the rest.
  """

  weights: Params
  act_amax: Mapping[str, jax.Array] | None = None
  kv_scales: Mapping[str, jax.Array] | None = None


def packable(model_cfg: ModelConfig, policy: PrecisionPolicy) -> bool:
  """Whether `policy`'s weight quantizers can be applied ahead of time (no stochastic ones)."""
  try:
    weights.check_packable(model_cfg, policy)
  except ValueError:
    return False
  return True


def quantize_for_sampler(params: Params, model_cfg: ModelConfig, policy: PrecisionPolicy
                         ) -> Params:
  """The trainer's `params` as the sampler holds them (`RolloutWeights.weights`). Traceable."""
  if not packable(model_cfg, policy):
    return params
  return weights.pack_params(params, model_cfg, policy)


def _bits(x: jax.Array) -> jax.Array:
  """x's bit patterns as unsigned integers (so NaN == NaN and -0 != +0 compare as stored)."""
  x = jnp.asarray(x)
  if jnp.issubdtype(x.dtype, jnp.floating):
    return lax.bitcast_convert_type(x, jnp.dtype(f"uint{8 * x.dtype.itemsize}"))
  return x


def _leaves(tree) -> list[tuple[str, jax.Array]]:
  flat, _ = jax.tree_util.tree_flatten_with_path(tree)
  return [(jax.tree_util.keystr(path, simple=True, separator="/"), leaf) for path, leaf in flat]


def tensor_names(held: RolloutWeights) -> list[str]:
  """Names of the compared tensors, in the order of `mismatches`' flags."""
  return [name for name, _ in _leaves(held)]


def mismatches(held: RolloutWeights, fresh: RolloutWeights) -> jax.Array:
  """One bool per tensor of `held`: True where it differs from `fresh` in any bit (or in shape,
  dtype, or presence). Traceable: compare inside the program that builds `fresh`."""
  a, b = _leaves(held), _leaves(fresh)
  fresh_by_name = dict(b)
  flags = []
  for name, x in a:
    y = fresh_by_name.get(name)
    same = (y is not None and x.shape == y.shape and x.dtype == y.dtype)
    flags.append(jnp.all(_bits(x) == _bits(y)) if same else jnp.bool_(False))
  flags = [jnp.logical_not(f) for f in flags]
  if len(a) != len(b):  # a tensor the sampler lacks counts once
    flags.append(jnp.bool_(True))
  return jnp.stack(flags) if flags else jnp.zeros((0,), bool)


_jit_mismatches = jax.jit(mismatches)


def make_refit_check(model_cfg: ModelConfig, policy: PrecisionPolicy,
                     calibrate: Callable[[Params], Any] | None = None
                     ) -> Callable[[RolloutWeights, Params], jax.Array]:
  """`check(held, trainer_params) -> bool[n_tensors]` (`mismatches` of `held` against a fresh
  quantization of `trainer_params`, and `calibrate(trainer_params)` for the activation scales
  when `held` has them). KV-cache calibration: a recipe that fills `held.kv_scales` passes a
  `calibrate` returning (act_amax, kv_scales).

  The fresh side runs the quantization program of `weights.pack_params` and `calibrate` as they
  are (a jitted `calibrate` is the sync's own calibration program), and the comparison is one
  small jitted program: the check compiles no second copy of the quantizers or of the
  calibration forward. Everything stays on the device until the flags.
  """

  def check(held: RolloutWeights, params: Params) -> jax.Array:
    act, kv = None, None
    if calibrate is not None:
      out = calibrate(params)
      act, kv = out if isinstance(out, tuple) else (out, None)
    fresh = RolloutWeights(quantize_for_sampler(params, model_cfg, policy),
                           act if held.act_amax is not None else None,
                           kv if held.kv_scales is not None else None)
    return _jit_mismatches(held, fresh)

  return check


class Refitter:
  """A sampler's side of the weight sync: `RolloutWeights` of the newest version it was given,
  rebuilt when the version changes, and the refit check at every `check_every`-th sync (0: off).

  `act_amax(params)`: the static activation amaxes of the sampler's recipe for `params` (None if
  it needs none); traceable. `log`: where a failed check's warning line goes.
  """

  def __init__(self, model_cfg: ModelConfig, policy: PrecisionPolicy,
               act_amax: Callable[[Params], Any], *, check_every: int = 1,
               log: Callable[[str], None] = print):
    self.model_cfg, self.policy, self.check_every, self.log = model_cfg, policy, check_every, log
    self._act_amax = act_amax
    self._packable = packable(model_cfg, policy)
    # Not a jit of its own: `pack_params`' program is the one the check's fresh side runs.
    self._pack = lambda p: quantize_for_sampler(p, model_cfg, policy)
    self.check = make_refit_check(model_cfg, policy, calibrate=act_amax)
    self.version, self.held, self.syncs = None, None, 0
    self.last: float | None = None  # mismatching tensors found by the latest check

  def quantize(self, params: Params) -> RolloutWeights:
    """What a sync hands the sampler for `params` (the trainer's weights)."""
    return RolloutWeights(self.pack(params), self._act_amax(params))

  def pack(self, params: Params) -> Params:
    """`RolloutWeights.weights` of `params`: the packed kernels (the trainer's tree when the
    recipe cannot be packed)."""
    return self._pack(params) if self._packable else params

  def __call__(self, params: Params, version: int | None
               ) -> tuple[RolloutWeights, dict[str, float]]:
    """(the sampler's weights for `version`, the refit metric): a new version is a sync, and
    every `check_every`-th sync (the first included) is checked. The metric is the latest
    check's count of mismatching tensors, logged at every call (so a resumed run, whose first
    call is a checked sync, logs what the uninterrupted one does); {} when checks are off.
    `version` None: a fresh sync every call."""
    if version is None or version != self.version:
      self.held, self.version = self.quantize(params), version
      self.syncs += 1
      if self.check_every and (self.syncs - 1) % self.check_every == 0:
        self.last = self.report(self.held, params)
    return self.held, ({} if self.last is None else {"refit/mismatched_tensors": self.last})

  def report(self, held: RolloutWeights, params: Params) -> float:
    """The refit check of `held` against `params`: the count of mismatching tensors, and a
    warning line naming them when it is not 0."""
    flags = jax.device_get(self.check(held, params))
    n = int(flags.sum())
    if n:
      names = [name for name, bad in zip(tensor_names(held), flags) if bad]
      self.log(f"[warn] refit check: {n} sampler tensor(s) differ from a fresh quantization of "
               f"the trainer's weights (version {self.version}): {', '.join(names[:4])}"
               f"{' ...' if n > 4 else ''}")
    return float(n)
