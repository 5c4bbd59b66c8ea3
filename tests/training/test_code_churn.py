"""lowrl.training.code_churn: the fraction of quantized weight codes / block scales / values an
update changes, on a hand-built NVFP4 case (expected codes written from the spec, not from the
code) and on a tiny model's tree, jitted and not."""
import jax
import jax.numpy as jnp
import numpy as np
import tiny

from lowrl import precision
from lowrl.models import init, layout
from lowrl.quant import QuantConfig, quantize
from lowrl.training import code_churn

NVFP4 = QuantConfig("nvfp4")


def _two_blocks(a1=1.0, b0=6.0):
  """32 elements = two NVFP4 blocks of 16; block A = [6, a1, 0, ...], block B = [b0, 0.5, 0, ...].

  By the spec (docs/reference.md §2): tensor amax 6 gives s_global = 6 / (6 * 448); a block of
  amax 6 gets the E4M3 scale e4m3(6 / 6 / s_global) = 448, so its elements are divided by
  448 * s_global = 1 exactly and rounded to the E2M1 grid 0, 0.5, 1, 1.5, 2, 3, 4, 6."""
  x = np.zeros(32, np.float32)
  x[0], x[1], x[16], x[17] = 6.0, a1, b0, 0.5
  return {"w": quantize(jnp.asarray(x), NVFP4)}


def test_an_update_below_half_a_step_changes_no_code_one_above_does():
  base = _two_blocks()
  # 1.0 -> 1.2: 0.2 < half the grid step at 1 (0.25): still rounds to 1.
  same = code_churn.churn(base, _two_blocks(a1=1.2))
  assert {k: float(v) for k, v in same.items()} == {
      "code_churn/codes": 0.0, "code_churn/values": 0.0, "code_churn/scales": 0.0,
      "code_churn/outer": 0.0}
  # 1.0 -> 1.3: past the midpoint 1.25, it rounds to 1.5: one code of 32 (and its value).
  moved = code_churn.churn(base, _two_blocks(a1=1.3))
  assert float(moved["code_churn/codes"]) == 1 / 32
  assert float(moved["code_churn/values"]) == 1 / 32
  assert float(moved["code_churn/scales"]) == 0.0


def test_a_block_amax_change_moves_its_scale_and_values_not_its_codes():
  # Block B's amax 6 -> 5 (the tensor amax stays 6): its scale e4m3(5 / 6 * 448 = 373.3) = 384
  # (E4M3 steps of 32 in [256, 512)); 5 / (384 / 448) = 5.83 -> code 6 and 0.5 / (6 / 7) = 0.58
  # -> code 0.5: no code changes, but both nonzero values of B do (the zeros stay 0).
  c = code_churn.churn(_two_blocks(), _two_blocks(b0=5.0))
  assert float(c["code_churn/codes"]) == 0.0
  assert float(c["code_churn/scales"]) == 1 / 2
  assert float(c["code_churn/values"]) == 2 / 32
  assert float(c["code_churn/outer"]) == 0.0


def test_sign_of_zero_is_a_code_change_but_not_a_value_change():
  x = jnp.zeros(16, jnp.float32).at[0].set(6.0)
  a = {"w": quantize(x.at[1].set(0.1), NVFP4)}   # rounds to +0
  b = {"w": quantize(x.at[1].set(-0.1), NVFP4)}  # rounds to -0
  c = code_churn.churn(a, b)
  assert float(c["code_churn/codes"]) == 1 / 16 and float(c["code_churn/values"]) == 0.0


def test_tree_churn_under_a_recipe_jitted_and_not():
  cfg = tiny.LOOP_MODEL
  policy = precision.make_policy(precision.recipe("nvfp4_recipe"), layout.matmuls(cfg))
  p0 = init.init_params(cfg, jax.random.key(0))
  # A move of 0.3 x the largest weight: most codes change.
  p1 = jax.tree.map(lambda w: w + 0.3 * jnp.max(jnp.abs(w)) * jnp.sign(w), p0)
  q0 = code_churn.weight_qtensors(p0, cfg, policy)
  # The recipe's NVFP4 layers (its last is BF16) and no LM head (FP32 in the recipe).
  assert q0 and all(p.startswith("layers_0/") for p in q0)
  assert all(v == 0.0 for v in code_churn.churn(q0, q0).values())
  eager = code_churn.churn(q0, code_churn.weight_qtensors(p1, cfg, policy))
  tracker = code_churn.CodeChurn(cfg, policy)  # the loop's, jitted
  tracker.start(p0)
  jitted = tracker.after_step(p1)
  assert jitted == {k: float(v) for k, v in eager.items()}
  assert jitted["code_churn/codes"] > 0.5
  # BF16 quantizes no weight: nothing to log.
  bf16 = precision.make_policy(precision.recipe("bf16"), layout.matmuls(cfg))
  assert code_churn.churn(code_churn.weight_qtensors(p0, cfg, bf16), {}) == {}
