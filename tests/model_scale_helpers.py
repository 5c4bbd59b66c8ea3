"""Shared pieces of tests/models/test_decoder.py and test_logprobs.py (the model-at-scale
knobs): small models, policies, batches and a jitted loss-and-gradients."""
import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

import tiny
from lowrl import precision
from lowrl.models import init, layout, logprobs
from lowrl.models.config import ModelConfig

# 3 layers: nvfp4_recipe's BF16 suffix (at least 1 layer) is its own scan group after a scan
# of 2 quantized layers, the fewest a real scan has (more layers, e.g. tiny.DEEP's 8, would only
# cost compile time).
DEEP = dataclasses.replace(tiny.DEEP, n_layers=3)
# 2 layers: a quantized layer then nvfp4_recipe's BF16 tail (remat); under a recipe without a BF16
# tail (nvfp4_naive) one real scan.
SHALLOW = dataclasses.replace(DEEP, n_layers=2)
U = 2.0 ** -24  # FP32 unit roundoff


def gamma(n: int) -> float:
  """Higham's gamma_n = n u / (1 - n u): relative error bound of an n-term FP32 sum/dot."""
  return n * U / (1 - n * U)


def _policy(name: str, cfg: ModelConfig = DEEP, **overrides) -> precision.PrecisionPolicy:
  return precision.policy_for(name, layout.matmuls(cfg), **overrides)


def _params(cfg: ModelConfig = DEEP):
  """Params of `cfg`'s tree, once per architecture: the execution knobs (scan, remat, chunked
  attention or log-probs) leave the tree as it is, so every knob variant reads its plain model's
  params."""
  return _init(dataclasses.replace(cfg, **_PLAIN_KNOBS))


_PLAIN_KNOBS = {f.name: f.default for f in dataclasses.fields(ModelConfig)
                if f.name in ("scan_layers", "remat", "attention", "attention_chunk",
                              "logprob_chunk")}


@functools.lru_cache(maxsize=None)
def _init(cfg: ModelConfig):
  """init_params' tree and distributions (kernels N(0, 1/fan_in), embedding N(0, 1/D), norm
  scales 1, biases 0), drawn by NumPy: init_params compiles an init program per model (~2 s of
  CPU each; these models are built nowhere else)."""
  rng = np.random.default_rng(0)

  def leaf(path, shape):
    name = path[-1].key
    if name in ("scale", "bias"):
      return jnp.full(shape.shape, 1.0 if name == "scale" else 0.0, shape.dtype)
    fan_in = shape.shape[1] if name == "embedding" else shape.shape[0]
    return jnp.asarray(rng.standard_normal(shape.shape) / np.sqrt(fan_in), shape.dtype)

  return jax.tree_util.tree_map_with_path(leaf, init.param_shapes(cfg))


def _batch(cfg: ModelConfig = DEEP, shape=(3, 12)):
  # NumPy's generator: jax.random would compile a program of its own (~1 s of CPU per shape).
  tokens = np.random.default_rng(1).integers(0, cfg.vocab_size, shape, dtype=np.int32)
  mask = np.ones(shape, bool)
  mask[0, :4] = False  # a left-padded row
  return jnp.asarray(tokens), jnp.asarray(mask)


def _same(a, b) -> bool:
  la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
  return len(la) == len(lb) and all(np.array_equal(x, y) for x, y in zip(la, lb))


def _loss_and_grads(cfg, policy, quant_key=None, act_amax=None):
  """((loss, (logp, entropy)), grads) on `_batch(cfg)`; without a key or static amaxes computed
  once per (cfg, policy) (several tests compare against the same plain program)."""
  if quant_key is None and act_amax is None:
    return _plain_loss_and_grads(cfg, policy)
  return _compute_loss_and_grads(cfg, policy, quant_key, act_amax)


@functools.lru_cache(maxsize=None)
def _plain_loss_and_grads(cfg, policy):
  return _compute_loss_and_grads(cfg, policy, None, None)


def _compute_loss_and_grads(cfg, policy, quant_key, act_amax):
  tokens, mask = _batch(cfg)

  def loss(p):
    logp, ent = logprobs.token_logprobs_and_entropy(p, tokens, cfg, policy, mask_BT=mask,
                                                       quant_key=quant_key, act_amax=act_amax)
    return jnp.sum(logp) + 0.1 * jnp.sum(ent), (logp, ent)

  return jax.jit(jax.value_and_grad(loss, has_aux=True))(_params(cfg))
