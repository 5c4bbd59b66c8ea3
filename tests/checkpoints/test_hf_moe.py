"""Qwen3-MoE / Qwen2-MoE checkpoints: config mapping, tensor layout, logits against an independent
NumPy FP64 forward of transformers' sparse MoE blocks, and save -> load identity.

The reference MLP is `moe_reference_mlp`, written from transformers' Qwen3MoeSparseMoeBlock
(modeling_qwen3_moe.py at huggingface/transformers 16b6c53c8ec3a720bd45c1c377bf94e1d01249c5) and
Qwen2MoeSparseMoeBlock (modeling_qwen2_moe.py at 00a3f9386614dde0dc41cf4e9b8d0abd3af0671d): softmax
of the gate's logits, top-k, optional renormalisation, a loop over experts adding each expert's
SwiGLU output times its weight into the selected tokens, plus sigmoid(shared_expert_gate(x)) *
shared_expert(x) for Qwen2-MoE. The attention is test_hf's FP64 reference.

FP32 bound: as for the dense families, |logits - reference| <= 1e-4 * max|reference| (FP32
rounding of ~10 chained matmuls/norms at these widths is ~1e-6 relative; the routing is the
reference's because every token's k-th and (k+1)-th probabilities differ by more than 1e-4, which
the test asserts, while FP32 moves them by ~1e-7).
"""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hf_builders import MOE_CONFIGS, MOE_FAMILIES, MOE_STORAGE, write_checkpoint
from test_hf import _assert_logits_close, _forward, _ids, _read_dir, hf_reference_logits
from test_hf import swiglu
from lowrl.checkpoints import (hf_config_from_model, load_hf_checkpoint, model_config_from_hf,
                               read_hf_config, save_hf_checkpoint)
from lowrl.models import layout
from lowrl.precision import policy_for


def moe_reference_mlp(x, linear, name, t, c, margins=None):
  """transformers' sparse MoE block in FP64 (module docstring); `margins` collects each token's
  gap between its k-th and (k+1)-th probability."""
  b, s, d = x.shape
  xf = x.reshape(-1, d)
  logits = xf @ t[name + ".gate.weight"].T
  probs = np.exp(logits - logits.max(-1, keepdims=True))
  probs /= probs.sum(-1, keepdims=True)
  k = c["num_experts_per_tok"]
  top = np.argsort(-probs, axis=-1, kind="stable")[:, :k]
  weights = np.take_along_axis(probs, top, axis=-1)
  if margins is not None:
    ordered = -np.sort(-probs, axis=-1)
    margins.append(float(np.min(ordered[:, k - 1] - ordered[:, k])))
  if c["norm_topk_prob"]:
    weights = weights / weights.sum(-1, keepdims=True)
  out = np.zeros_like(xf)
  for e in range(c["num_experts"]):
    tok, j = np.nonzero(top == e)
    out[tok] += swiglu(xf[tok], linear, f"{name}.experts.{e}") * weights[tok, j, None]
  if name + ".shared_expert_gate.weight" in t:
    gate = xf @ t[name + ".shared_expert_gate.weight"].T
    out += swiglu(xf, linear, name + ".shared_expert") / (1 + np.exp(-gate))
  return out.reshape(b, s, d)


def test_model_config_from_hf_and_back():
  q3, q2 = (model_config_from_hf(MOE_CONFIGS[f]) for f in MOE_FAMILIES)
  assert (q3.n_experts, q3.n_experts_per_tok, q3.moe_d_ff, q3.norm_topk_prob,
          q3.shared_expert_d_ff, q3.qk_norm, q3.qkv_bias) == (4, 2, 32, True, 0, True, False)
  assert (q2.n_experts, q2.n_experts_per_tok, q2.moe_d_ff, q2.norm_topk_prob,
          q2.shared_expert_d_ff, q2.qk_norm, q2.qkv_bias) == (4, 2, 32, False, 48, False, True)
  for family, cfg in zip(MOE_FAMILIES, (q3, q2)):
    c = MOE_CONFIGS[family]
    assert hf_config_from_model(cfg, dtype=jnp.float32, extra=c) == {**c, "torch_dtype":
                                                                     "float32"}
    assert hf_config_from_model(cfg)["model_type"] == family  # inferred


@pytest.mark.parametrize("change, match", [
    ({"decoder_sparse_step": 2}, "decoder_sparse_step"),
    ({"mlp_only_layers": [1]}, "mlp_only_layers"),
    ({"num_experts": None}, "num_experts"),
])
def test_unsupported_moe_configs_are_refused(change, match):
  c = {k: v for k, v in MOE_CONFIGS["qwen3_moe"].items() if change.get(k, 0) is not None}
  c.update({k: v for k, v in change.items() if v is not None})
  with pytest.raises(ValueError, match=match):
    model_config_from_hf(c)


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_load_stacks_experts_and_logits_match_reference(tmp_path, family):
  path, raw = write_checkpoint(tmp_path, family)
  c = MOE_CONFIGS[family]
  cfg, params = load_hf_checkpoint(path)
  mlp, hf = params["layers_1"]["mlp"], "model.layers.1.mlp."
  np.testing.assert_array_equal(mlp["router"]["kernel"], raw[hf + "gate.weight"].T)
  for e in range(4):
    np.testing.assert_array_equal(mlp["experts"]["down_proj"]["kernel"][e],
                                  raw[f"{hf}experts.{e}.down_proj.weight"].T)
    np.testing.assert_array_equal(mlp["experts"]["up_proj"]["kernel"][e],
                                  raw[f"{hf}experts.{e}.up_proj.weight"].T)
  assert ("shared_expert" in mlp) == (family == "qwen2_moe")
  assert sum(x.size for x in jax.tree.leaves(params)) == sum(v.size for v in raw.values())
  assert sum(x.size for x in jax.tree.leaves(params)) == cfg.num_params()

  ids = _ids(c)
  ours = _forward(params, jnp.asarray(ids), cfg, policy_for("fp32", layout.matmuls(cfg)))
  margins = []
  ref = hf_reference_logits(
      raw, c, ids, mlp=lambda *a: moe_reference_mlp(*a, margins=margins))
  assert min(margins) > 1e-4, margins  # the routing is not decided by rounding
  assert ref.std() > 1.0
  _assert_logits_close(ours, ref, family)
  # The routing matters: with top-1 instead of top-2 the logits move far beyond the bound.
  top1 = hf_reference_logits(raw, {**c, "num_experts_per_tok": 1}, ids, mlp=moe_reference_mlp)
  assert np.abs(top1 - ref).max() > 100 * 1e-4 * np.abs(ref).max()


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_save_load_round_trip_is_exact(tmp_path, family):
  path, raw = write_checkpoint(tmp_path, family)
  cfg, params = load_hf_checkpoint(path)
  out = str(tmp_path / "saved")
  save_hf_checkpoint(out, cfg, params, dtype=MOE_STORAGE[family][0],
                     extra_config=read_hf_config(path), max_shard_bytes=20_000)
  saved = _read_dir(out)
  assert sorted(saved) == sorted(raw)
  assert all(saved[n].tobytes() == raw[n].tobytes() for n in raw)
  cfg2, params2 = load_hf_checkpoint(out)
  assert cfg2 == cfg
  for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(params2)):
    assert np.array_equal(np.asarray(a), np.asarray(b))
  ids = jnp.asarray(_ids(MOE_CONFIGS[family]))
  policy = policy_for("fp32", layout.matmuls(cfg))
  np.testing.assert_array_equal(np.asarray(_forward(params, ids, cfg, policy)),
                                np.asarray(_forward(params2, ids, cfg2, policy)))


def test_save_refuses_a_family_that_does_not_match(tmp_path):
  cfg = model_config_from_hf(MOE_CONFIGS["qwen3_moe"])
  with pytest.raises(ValueError, match="disagree"):
    hf_config_from_model(cfg, model_type="qwen3")
  with pytest.raises(ValueError, match="shared expert"):
    hf_config_from_model(dataclasses.replace(cfg, qk_norm=False, qkv_bias=True))


def test_sharded_load_reads_each_devices_experts(tmp_path):
  """On an expert-parallel mesh of the 8 fake devices each device's slice of a stacked kernel is
  read from its experts' tensors: the global arrays equal the unsharded load."""
  from lowrl import sharding
  from lowrl.checkpoints import load_hf_params
  path, _ = write_checkpoint(tmp_path, "qwen2_moe")
  cfg, params = load_hf_checkpoint(path)
  plan = sharding.ShardingPlan(
      sharding.make_mesh((2, 4, 1), ("data", sharding.EXPERT, "model")),
      rules=sharding.expert_parallel_rules(), batch_axes=("data", sharding.EXPERT))
  placed = load_hf_params(path, cfg, shardings=plan.param_shardings(params))
  kernel = placed["layers_0"]["mlp"]["experts"]["gate_proj"]["kernel"]
  assert {s.data.shape[0] for s in kernel.addressable_shards} == {1}  # one expert per device
  for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(placed)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
