"""lowrl.models.init: the fused and split programs of init_params' draw, and which one runs."""
import functools
import math

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import tiny
from lowrl.models import config as model_config
from lowrl.models import init

# FP32 ulp bound between the two programs' normal draws: the same counters through the same
# jax.random.normal, compiled in two XLA programs whose erf_inv/log code may differ by a few ulp
# (the README measures up to 4 ulp for exp between LLVM levels); 8 ulp relative leaves margin.
DRAW_RTOL = 8 * 2.0 ** -23


def _reference(cfg, rng, dtype):
  """The documented values, assembled in NumPy from the split program's own draw and the spec
  (not init's own tables): the random leaves are the kernels and the embedding in the tree's
  flattening order, leaf k = draw[offset_k : offset_k + size_k] * fan_in^-1/2 with fan_in = D for
  the [V, D] embedding and the input width (the axis before the last) for a kernel; norm scales
  are 1, biases 0."""
  flat, treedef = jax.tree_util.tree_flatten_with_path(init.param_shapes(cfg))
  names = [jax.tree_util.keystr(path, simple=True, separator="/") for path, _ in flat]
  shapes = [tuple(leaf.shape) for _, leaf in flat]
  random = [i for i, n in enumerate(names) if n.endswith(("/kernel", "embed/embedding"))]
  sizes = [math.prod(shapes[i]) for i in random]
  width = functools.reduce(math.gcd, sizes)
  draw = np.asarray(init._normal_fn(sum(sizes), width)(rng)).reshape(-1)
  out, offset = [], 0
  for i, (name, shape) in enumerate(zip(names, shapes)):
    if i in random:
      fan_in = shape[1] if name.endswith("embedding") else shape[-2]
      value = draw[offset:offset + math.prod(shape)].reshape(shape) * np.float32(fan_in ** -0.5)
      offset += math.prod(shape)
    else:
      assert name.endswith(("/scale", "/bias")), name
      value = np.full(shape, 1.0 if name.endswith("scale") else 0.0, np.float32)
    out.append(value.astype(ml_dtypes.bfloat16 if dtype == jnp.bfloat16 else np.float32))
  return jax.tree_util.tree_unflatten(treedef, out)


def _bits(tree):
  return [np.asarray(x).view(np.uint8) for x in jax.tree.leaves(tree)]


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_split_init_is_the_documented_slices_of_its_draw(dtype):
  rng = jax.random.key(3)
  got = init.init_params(tiny.FULL, rng, dtype, method="split")
  want = _reference(tiny.FULL, rng, dtype)
  assert jax.tree.structure(got) == jax.tree.structure(want)
  for g, w in zip(_bits(got), _bits(want)):
    np.testing.assert_array_equal(g, w)


def test_split_and_fused_draw_the_same_normals():
  rng = jax.random.key(5)
  fused = init.init_params(tiny.TINY, rng, method="fused")
  split = init.init_params(tiny.TINY, rng, method="split")
  assert jax.tree.structure(fused) == jax.tree.structure(split)
  for f, s in zip(jax.tree.leaves(fused), jax.tree.leaves(split)):
    assert f.dtype == s.dtype and f.shape == s.shape
    np.testing.assert_allclose(np.asarray(s), np.asarray(f), rtol=DRAW_RTOL, atol=0)


def test_auto_is_fused_up_to_the_threshold_and_split_above(monkeypatch):
  rng = jax.random.key(0)
  # Identical programs, so bit for bit: the repository's models keep the fused values.
  assert tiny.TINY.num_params() <= init.FUSED_MAX_PARAMS
  for a, f in zip(_bits(init.init_params(tiny.TINY, rng)),
                  _bits(init.init_params(tiny.TINY, rng, method="fused"))):
    np.testing.assert_array_equal(a, f)
  monkeypatch.setattr(init, "FUSED_MAX_PARAMS", tiny.TINY.num_params() - 1)
  for a, s in zip(_bits(init.init_params(tiny.TINY, rng)),
                  _bits(init.init_params(tiny.TINY, rng, method="split"))):
    np.testing.assert_array_equal(a, s)


def test_split_traces_a_real_size_model_abstractly():
  # An 8B model's draw has more than 2^31 elements: the split program indexes rows of
  # [n / w, w], so its start indices stay int32; eval_shape traces it without allocating.
  cfg = model_config.preset("qwen3_8b")
  assert cfg.num_params() > 2 ** 31
  shapes = jax.eval_shape(lambda k: init.init_params(cfg, k, jnp.bfloat16, method="split"),
                          jax.random.key(0))
  assert shapes == init.param_shapes(cfg, jnp.bfloat16)


def test_unknown_method_is_a_one_line_error():
  with pytest.raises(ValueError, match="use one of"):
    init.init_params(tiny.TINY, jax.random.key(0), method="numpy")
