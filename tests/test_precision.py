"""Precision policy: recipe assignment tables, one-flag knobs, validation."""
import jax
import jax.numpy as jnp
import ml_collections
import pytest

from lowrl.models import layout
from lowrl import precision, quant_blocks, sharding
from lowrl.models.config import ModelConfig
from lowrl.quant.config import QDotConfig, QuantConfig

# 8 layers: the 4-bitter tail is round(0.15 * 8) = 1 layer (layer 7).
CFG8 = ModelConfig(vocab_size=64, d_model=64, n_layers=8, n_heads=4, n_kv_heads=2, head_dim=16,
                   d_ff=128)

_RECIPE_OPTS = "act_per_token,four_over_six,gemm=bfloat16"
# recipe -> {layers (tuple) or "lm_head": (format, backward, options)}; every (layer, path) of the
# 8-layer model is covered exactly once, the 7 linear layers of a block alike.
EXPECTED = {
    "fp32": {tuple(range(8)): ("float32", "-", ""), "lm_head": ("float32", "-", "")},
    "bf16": {tuple(range(8)): ("bfloat16", "-", ""), "lm_head": ("float32", "-", "")},
    "fp16": {tuple(range(8)): ("float16", "-", ""), "lm_head": ("float32", "-", "")},
    "mxfp8": {tuple(range(8)): ("mxfp8_e4m3", "high_precision", "gemm=bfloat16"),
              "lm_head": ("float32", "-", "")},
    "nvfp4_naive": {tuple(range(8)): ("nvfp4", "high_precision", "gemm=bfloat16"),
                    "lm_head": ("float32", "-", "")},
    "nvfp4_recipe": {(0, 1, 2, 3, 4, 5, 6): ("nvfp4", "dequantized", _RECIPE_OPTS),
                     (7,): ("bfloat16", "-", ""),
                     "lm_head": ("float32", "-", "")},
    # A dense model has no routed experts: nothing quantized.
    "nvfp4_moe_experts": {tuple(range(8)): ("bfloat16", "-", ""),
                          "lm_head": ("float32", "-", "")},
    "nvfp4_w4a16": {tuple(range(8)): ("bfloat16/nvfp4", "dequantized", "gemm=bfloat16"),
                    "lm_head": ("float32", "-", "")},
}


def _expand(expected):
  rows = []
  for key, (fmt, backward, opts) in expected.items():
    if key == "lm_head":
      continue
    for layer in key:
      for path in layout.BLOCK_MATMULS:
        rows.append(precision.Assignment(layer, path, fmt, backward, opts))
  rows.sort(key=lambda r: (r.layer, layout.BLOCK_MATMULS.index(r.path)))
  return rows + [precision.Assignment(None, "lm_head", *expected["lm_head"])]


@pytest.mark.parametrize("name", precision.RECIPES)
def test_recipe_assignment_table(name):
  policy = precision.make_policy(precision.recipe(name), layout.matmuls(CFG8))
  table = precision.assignment_table(policy, layout.matmuls(CFG8))
  print(f"\n{name}\n{precision.format_table(table)}")
  assert len(table) == 8 * 7 + 1
  assert table == _expand(EXPECTED[name])


def test_recipe_quantizers_are_the_documented_ones():
  rec = precision.policy_for("nvfp4_recipe", layout.matmuls(CFG8)).qdot_config("layers_0/mlp/up_proj")
  assert rec == QDotConfig(
      lhs=QuantConfig("nvfp4", per_token=True, four_over_six=True),
      rhs=QuantConfig("nvfp4", four_over_six=True),
      backward="dequantized", compute_dtype="bfloat16")
  naive = precision.policy_for("nvfp4_naive", layout.matmuls(CFG8)).qdot_config("layers_3/attn/o_proj")
  assert naive == QDotConfig(lhs=QuantConfig("nvfp4"), rhs=QuantConfig("nvfp4"),
                             backward="high_precision", compute_dtype="bfloat16")
  w4a16 = precision.policy_for("nvfp4_w4a16", layout.matmuls(CFG8))
  assert w4a16.qdot_config("layers_7/attn/k_proj") == QDotConfig(
      lhs=None, rhs=QuantConfig("nvfp4"), backward="dequantized", compute_dtype="bfloat16")
  assert w4a16.weight_scales == "fused"
  assert precision.policy_for("nvfp4_recipe", layout.matmuls(CFG8),
                              weight_scales="per_linear").weight_scales == "per_linear"
  mx = precision.policy_for("mxfp8", layout.matmuls(CFG8)).qdot_config("layers_5/attn/q_proj")
  assert mx.lhs == mx.rhs == QuantConfig("mxfp8_e4m3", scale_rounding="rceil")
  assert mx.compute_dtype == "bfloat16"


@pytest.mark.parametrize("n_layers, tail", [(1, (0,)), (2, (1,)), (6, (5,)), (8, (7,)),
                                            (10, (8, 9)), (28, (24, 25, 26, 27)),
                                            (48, tuple(range(41, 48)))])
def test_bf16_tail_is_last_15_percent_at_least_one(n_layers, tail):
  assert precision.bf16_tail_layers(n_layers, 0.15) == tail
  cfg = ModelConfig(vocab_size=64, d_model=32, n_layers=n_layers, n_heads=2, n_kv_heads=1,
                    head_dim=16, d_ff=64)
  policy = precision.policy_for("nvfp4_recipe", layout.matmuls(cfg))
  plain = {r.layer for r in precision.assignment_table(policy, layout.matmuls(cfg))
           if r.layer is not None and r.fmt == "bfloat16"}
  assert plain == set(tail)


def test_each_knob_is_one_flag():
  base = precision.policy_for("nvfp4_recipe", layout.matmuls(CFG8))

  def q(**kw):
    return precision.policy_for("nvfp4_recipe", layout.matmuls(CFG8), **kw).qdot_config("layers_7/mlp/down_proj")

  assert not base.qdot_config("layers_7/mlp/down_proj").quantized
  assert q(bf16_last_fraction=0.0).lhs.fmt == "nvfp4"
  assert q(bf16_last_fraction=0.0, backward="high_precision").backward == "high_precision"
  assert not q(bf16_last_fraction=0.0, act_per_token=False).lhs.per_token
  no46 = q(bf16_last_fraction=0.0, four_over_six=False)
  assert not no46.lhs.four_over_six and not no46.rhs.four_over_six
  assert q(bf16_last_fraction=0.0, weight_block_2d=True).rhs.block_2d
  sr = precision.policy_for("nvfp4_recipe", layout.matmuls(CFG8), stochastic_rounding="all")
  assert sr.needs_key and not base.needs_key
  assert sr.qdot_config("layers_0/attn/q_proj").lhs.stochastic_rounding
  grad = precision.policy_for("nvfp4_recipe", layout.matmuls(CFG8), backward="quantized",
                              stochastic_rounding="grad").qdot_config("layers_0/attn/q_proj")
  assert grad.grad == QuantConfig("nvfp4", stochastic_rounding=True)
  assert not grad.lhs.stochastic_rounding
  assert precision.policy_for("nvfp4_recipe", layout.matmuls(CFG8),
                              compute_dtype="float32").compute_dtype == "float32"
  head = precision.policy_for("nvfp4_recipe", layout.matmuls(CFG8),
                              quantize_lm_head=True).qdot_config("lm_head")
  assert head.lhs.fmt == "nvfp4"
  mx = precision.policy_for("nvfp4_naive", layout.matmuls(CFG8), format="mxfp8_e4m3").qdot_config("layers_0/attn/q_proj")
  assert mx.rhs.fmt == "mxfp8_e4m3"


def test_high_precision_paths_regex_and_first_match_wins():
  policy = precision.policy_for("nvfp4_naive", layout.matmuls(CFG8), high_precision_paths=r"layers_[02]/mlp/.*")
  table = {(r.layer, r.path): r.fmt for r in precision.assignment_table(policy, layout.matmuls(CFG8))}
  assert table[(0, "mlp/down_proj")] == table[(2, "mlp/gate_proj")] == "bfloat16"
  assert table[(1, "mlp/down_proj")] == table[(0, "attn/q_proj")] == "nvfp4"
  # An explicit rule list: the first match wins, fullmatch semantics.
  a, b = QDotConfig(compute_dtype="bfloat16"), QDotConfig(compute_dtype="float16")
  pol = precision.PrecisionPolicy(rules=((r"layers_1/.*", a), (r".*proj", b), (".*", a)))
  assert pol.qdot_config("layers_1/attn/q_proj") is a
  assert pol.qdot_config("layers_0/attn/q_proj") is b
  assert pol.qdot_config("lm_head") is a
  with pytest.raises(ValueError, match="catch-all"):
    precision.PrecisionPolicy(rules=((r"layers_1/.*", a),)).qdot_config("layers_0/attn/q_proj")


def test_policy_is_hashable_and_a_jit_static_argument():
  p1 = precision.policy_for("nvfp4_recipe", layout.matmuls(CFG8))
  p2 = precision.make_policy(precision.recipe("nvfp4_recipe"), layout.matmuls(CFG8))
  assert p1 == p2 and hash(p1) == hash(p2)
  assert p1 != precision.policy_for("nvfp4_recipe", layout.matmuls(CFG8), bf16_last_fraction=0.0)
  f = jax.jit(lambda x, policy: x.astype(policy.dtype), static_argnums=1)
  assert f(jnp.ones(2), p1).dtype == jnp.bfloat16


@pytest.mark.parametrize("knob, value, match", [
    ("format", "nvfp3", "precision.format"),
    ("compute_dtype", "float8", "precision.compute_dtype"),
    ("backward", "dequant", "precision.backward"),
    ("bf16_last_fraction", 1.5, "precision.bf16_last_fraction"),
    ("bf16_last_fraction", -0.1, "precision.bf16_last_fraction"),
    ("stochastic_rounding", "yes", "precision.stochastic_rounding"),
    ("stochastic_rounding", "grad", "backward=quantized"),
    ("grad_format", "int4", "precision.grad_format"),
    ("high_precision_paths", "layers_(", "high_precision_paths"),
    ("lm_head_dtype", "int8", "precision.lm_head_dtype"),
    ("act_format", "nvfp4", "precision.act_format"),
    ("weight_scales", "shared", "precision.weight_scales"),
])
def test_bad_values_name_the_flag(knob, value, match):
  with pytest.raises(ValueError, match=match):
    precision.policy_for("nvfp4_recipe", layout.matmuls(CFG8), **{knob: value})


def test_inconsistent_knobs_name_the_fix():
  with pytest.raises(ValueError, match="precision.act_per_token"):
    precision.policy_for("nvfp4_recipe", layout.matmuls(CFG8), format="mxfp8_e4m3")
  with pytest.raises(ValueError, match="precision.four_over_six"):
    precision.policy_for("nvfp4_recipe", layout.matmuls(CFG8), format="mxfp8_e4m3", act_per_token=False)
  with pytest.raises(ValueError, match="needs a quantized format"):
    precision.policy_for("bf16", layout.matmuls(CFG8), backward="dequantized")
  with pytest.raises(ValueError, match="act_per_token=False or precision.act_format"):
    precision.policy_for("nvfp4_recipe", layout.matmuls(CFG8), act_format="none")
  with pytest.raises(ValueError, match="precision.gemm=emulated"):
    precision.policy_for("mxfp8", layout.matmuls(CFG8), act_format="none", gemm="native")
  with pytest.raises(ValueError, match="weight_scales"):
    precision.PrecisionPolicy(rules=(), weight_scales="shared")
  with pytest.raises(ValueError, match="Unknown precision recipe"):
    precision.recipe("nvfp4")
  with pytest.raises(ValueError, match="Unknown precision knob"):
    precision.policy_for("bf16", layout.matmuls(CFG8), bf16_last=0.0)
  with pytest.raises(ValueError, match="lacks"):
    c = precision.recipe("bf16").to_dict()
    del c["format"]
    precision.make_policy(ml_collections.ConfigDict(c), layout.matmuls(CFG8))


def test_block_sizes_checked_against_the_model():
  odd = ModelConfig(vocab_size=64, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16,
                    d_ff=72)
  one_device = sharding.single_device_plan()

  def check(name, model_cfg, **kw):
    policy = precision.policy_for(name, layout.matmuls(model_cfg), **kw)
    quant_blocks.check_quant_blocks(policy, model_cfg, one_device)

  with pytest.raises(ValueError, match=r"layers_0/mlp/down_proj.*72 wide.*high_precision_paths"):
    check("nvfp4_naive", odd)
  # The suggested fix works; 1-D blocks run along the contracting axis only (gate/up: 64).
  check("nvfp4_naive", odd, high_precision_paths=".*/down_proj")
  with pytest.raises(ValueError, match="mxfp8_e4m3 blocks of 32 .* 48 wide, not a multiple"):
    check("mxfp8", ModelConfig(vocab_size=64, d_model=48, n_layers=1, n_heads=3, n_kv_heads=1,
                               head_dim=16, d_ff=64))
  # Unquantized recipes accept any width.
  check("bf16", odd)


MOE = ModelConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8,
                  d_ff=64, n_experts=4, n_experts_per_tok=2, moe_d_ff=32, shared_expert_d_ff=16)


@pytest.mark.parametrize("name, expert_fmt, router, shared", [
    ("nvfp4_moe_experts", "nvfp4", "bfloat16", "bfloat16"),
    ("nvfp4_recipe", "nvfp4", "float32", "nvfp4"),  # layer 0; layer 1 is the BF16 tail
    ("bf16", "bfloat16", "float32", "bfloat16"),
])
def test_moe_matmuls_by_name(name, expert_fmt, router, shared):
  ms = layout.matmuls(MOE)
  rows = {(r.layer, r.path): r for r in
          precision.assignment_table(precision.policy_for(name, ms), ms)}
  assert {p for _, p in rows} >= set(layout.MOE_MATMULS)
  for path in layout.EXPERT_MATMULS:
    assert rows[0, path].fmt == expert_fmt
  assert rows[0, layout.ROUTER].fmt == rows[0, "mlp/shared_expert_gate"].fmt == router
  assert rows[0, "mlp/shared_expert/up_proj"].fmt == shared
  assert rows[None, "lm_head"].fmt == "float32"
  if name == "nvfp4_moe_experts":
    assert {r.fmt for r in rows.values() if r.path not in layout.EXPERT_MATMULS} <= {
        "bfloat16", "float32"}


def test_router_quantized_only_when_asked():
  ms = layout.matmuls(MOE)
  policy = precision.policy_for("nvfp4_naive", ms)
  assert not policy.qdot_config("layers_1/mlp/router").quantized
  asked = precision.prepend_rules(
      policy, ((precision.ROUTER, policy.qdot_config("layers_1/mlp/experts/up_proj")),))
  assert asked.qdot_config("layers_1/mlp/router").quantized
  # Dense models get no router rule: their policies are what they were.
  dense = precision.policy_for("nvfp4_recipe", layout.matmuls(CFG8))
  assert all(pattern != precision.ROUTER for pattern, _ in dense.rules)
