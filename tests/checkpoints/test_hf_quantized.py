"""The NVFP4 rollout export read as inference engines read it: vLLM's fused q/k/v and gate/up
linears, and compressed-tensors' ModelOpt converter, equal the sampler's weights bit for bit.

Both readers are written here from the other libraries' source (not from lowrl's code):

* vLLM (vllm-project/vllm@00155cdecca722d98e34234c3d172725b7720b7d,
  vllm/model_executor/layers/quantization/modelopt.py): a fused linear's `weight` and
  `weight_scale` are the partitions' rows concatenated in order (q, k, v / gate, up), its
  `weight_scale_2` holds one entry per partition (`PerTensorScaleParameter` of
  `len(output_partition_sizes)`), and `ModelOptNvFp4LinearMethod` / `ModelOptNvFp4W4A16LinearMethod
  .process_weights_after_loading` keep `weight_scale_2.max()` as the global scale without touching
  the block scales. A weight element is then e2m1(nibble) * e4m3(weight_scale) * global (the
  kernels apply the global scale to the product, `alpha`; code * block scale is exact).
* compressed-tensors (vllm-project/compressed-tensors,
  src/compressed_tensors/entrypoints/convert/converters/modelopt_nvfp4.py @011e0161:
  `weight_global_scale = 1 / weight_scale_2`; compressors/nvfp4/base.py and
  quantization/lifecycle/forward.py @01dd1a58: codes and block scales unpacked to BF16,
  `scale = weight_scale / weight_global_scale`, `code.to(scale.dtype) * scale`, cast to BF16). With
  [1]-shaped FP32 global scales the quotient is FP32 (PyTorch type promotion).
"""
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import tiny
from lowrl import precision
from lowrl.checkpoints import hf_quantized
from lowrl.models import init, layout
from lowrl.sampling import weights

TINY = tiny.TINY  # D=32, q 32, k/v 16, F=64: every width a multiple of 16
# E2M1 magnitudes by a nibble's low 3 bits (OCP MX spec); bit 3 is the sign.
_E2M1 = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], np.float32)
_F32 = np.float32


def _params():
  params = init.init_params(TINY, jax.random.key(3))
  # Partitions of one fused group with clearly different ranges (as trained q/k/v are).
  for i, scale in ((0, 0.6), (1, 1.7)):
    attn = params[f"layers_{i}"]["attn"]
    attn["k_proj"]["kernel"] = attn["k_proj"]["kernel"] * scale
    params[f"layers_{i}"]["mlp"]["up_proj"]["kernel"] *= 1.3
  return params


def _e2m1(packed: np.ndarray) -> np.ndarray:
  nib = np.stack([packed & 0xF, packed >> 4], axis=-1).reshape(packed.shape[0], -1)
  return _E2M1[nib & 7] * np.where(nib & 8, -1.0, 1.0).astype(_F32)


def _module(tensors, name):
  return {k.removeprefix(name + "."): v for k, v in tensors.items() if k.startswith(name + ".")}


def vllm_fused_weight(tensors, names) -> np.ndarray:
  """vLLM's reading of the partitions `names` loaded into one fused linear: [sum out, in] FP32."""
  parts = [_module(tensors, n) for n in names]
  codes = np.concatenate([_e2m1(p["weight"]) for p in parts])
  block = np.concatenate([p["weight_scale"].astype(_F32) for p in parts])
  scale_2 = np.array([np.asarray(p["weight_scale_2"], _F32).reshape(()) for p in parts])
  global_scale = scale_2.max()
  return (codes * np.repeat(block, 16, axis=1)) * global_scale


def ct_weight(t) -> np.ndarray:
  """compressed-tensors' dequantization of one converted ModelOpt NVFP4 linear (BF16)."""
  global_scale = _F32(1.0) / np.asarray(t["weight_scale_2"], _F32)  # shape [1]: FP32
  block = t["weight_scale"].astype(ml_dtypes.bfloat16).astype(_F32)
  scale = np.repeat(block, 16, axis=1) / global_scale
  codes = _e2m1(t["weight"]).astype(ml_dtypes.bfloat16).astype(_F32)
  return (codes * scale).astype(ml_dtypes.bfloat16)


def _export(tmp_path, params, recipe, fmt="nvfp4", **overrides):
  policy = precision.policy_for(recipe, layout.matmuls(TINY), **overrides)
  act_amax = {m.full_path: jnp.float32(2.0 + 0.25 * k)
              for k, m in enumerate(layout.matmuls(TINY)) if m.layer is not None}
  hf_quantized.save_quantized_checkpoint(tmp_path, TINY, params, fmt, act_amax=act_amax,
                                         policy=policy)
  return policy, hf_quantized.read_safetensors(tmp_path / "model.safetensors"), act_amax


def _sampler_weight(sampler_params, m) -> np.ndarray:
  """The sampler's dequantized kernel (quantize_weights), [out, in] as HF stores it."""
  return np.asarray(layout.get_param(sampler_params, m.param_keys)).T


def _linears(layer):
  """(HF names, Matmuls) per linear as vLLM builds them: fused groups, then o_proj, down_proj."""
  ms = {m.path: m for m in layout.matmuls(TINY) if m.layer == layer}
  groups = [tuple(ms[p] for p in g) for g in layout.FUSED_GROUPS]
  return groups + [(ms["attn/o_proj"],), (ms["mlp/down_proj"],)]


def _differing(tensors, sampler_params):
  """(fraction of values, [fused groups]) where vLLM's reading differs from the sampler."""
  n_diff = n = 0
  groups = []
  for layer in range(TINY.n_layers):
    for ms in _linears(layer):
      if f"{ms[0].hf_name}.weight_scale" not in tensors:
        continue
      got = vllm_fused_weight(tensors, [m.hf_name for m in ms])
      want = np.concatenate([_sampler_weight(sampler_params, m) for m in ms])
      d = int(np.sum(got != want))
      n_diff, n = n_diff + d, n + want.size
      if d and len(ms) > 1:
        groups.append(tuple(m.full_path for m in ms))
  return n_diff / n, groups


@pytest.mark.parametrize("recipe,fmt", [("nvfp4_naive", "nvfp4"), ("nvfp4_recipe", "nvfp4"),
                                        ("nvfp4_w4a16", "nvfp4_w4a16")])
def test_engine_readings_are_the_sampler_weights(tmp_path, recipe, fmt):
  params = _params()
  policy, tensors, act_amax = _export(tmp_path, params, recipe, fmt)
  sampler_params, _ = weights.quantize_weights(params, TINY, policy)
  frac, groups = _differing(tensors, sampler_params)
  assert frac == 0.0 and not groups
  config = __import__("json").loads((tmp_path / "config.json").read_text())
  ignore = config["quantization_config"]["ignore"]
  for layer in range(TINY.n_layers):
    for ms in _linears(layer):
      quantized = policy.qdot_config(ms[0].full_path).rhs is not None
      for m in ms:
        t = _module(tensors, m.hf_name)
        if not quantized:  # nvfp4_recipe's BF16 tail: unquantized, excluded for vLLM
          assert m.hf_name in ignore and set(t) == {"weight"}
          np.testing.assert_array_equal(t["weight"], np.asarray(
              layout.get_param(params, m.param_keys)).T)
          continue
        # Per-tensor scales of shape [1], one global scale per fused group.
        assert t["weight_scale_2"].shape == (1,) and t["weight_scale_2"].dtype == _F32
        assert t["weight_scale_2"] == _module(tensors, ms[0].hf_name)["weight_scale_2"]
        if fmt == "nvfp4":
          assert t["input_scale"].shape == (1,)
          joint = max(float(act_amax[x.full_path]) for x in ms)
          assert t["input_scale"][0] == _F32(joint) / _F32(2688.0)
        else:
          assert "input_scale" not in t
        want = _sampler_weight(sampler_params, m)
        np.testing.assert_array_equal(ct_weight(t), want.astype(ml_dtypes.bfloat16))
  assert config["quantization_config"]["quant_algo"] == {"nvfp4": "NVFP4",
                                                         "nvfp4_w4a16": "W4A16_NVFP4"}[fmt]


def test_per_linear_scales_are_rescaled_by_vllm(tmp_path):
  """The option that keeps one scale per linear: vLLM's fused reading then rescales partitions
  (the issue's figure: 39% of values on a small model); the fused default: none."""
  params = _params()
  fracs = {}
  for scales in ("per_linear", "fused"):
    policy, tensors, _ = _export(tmp_path / scales, params, "nvfp4_naive", weight_scales=scales)
    sampler_params, _ = weights.quantize_weights(params, TINY, policy)
    fracs[scales] = _differing(tensors, sampler_params)
  frac, groups = fracs["per_linear"]
  print(f"\nvLLM's fused reading vs the sampler (nvfp4_naive, tiny model): per_linear "
        f"{frac:.1%} of values differ in {len(groups)} of 4 fused groups; fused "
        f"{fracs['fused'][0]:.1%}")
  assert frac > 0.1 and len(groups) == 4
  assert fracs["fused"] == (0.0, [])


def test_fused_scale_is_the_max_of_per_linear_scales(tmp_path):
  """The shared global scale is what vLLM would pick from per-linear files (RNE is monotone)."""
  params = _params()
  _, per_linear, _ = _export(tmp_path / "a", params, "nvfp4_naive", weight_scales="per_linear")
  _, fused, _ = _export(tmp_path / "b", params, "nvfp4_naive")
  for layer in range(TINY.n_layers):
    for ms in _linears(layer)[:2]:
      names = [f"{m.hf_name}.weight_scale_2" for m in ms]
      assert len({float(per_linear[n][0]) for n in names}) > 1
      for n in names:
        assert fused[n][0] == max(per_linear[x][0] for x in names)


def test_export_policy_refuses_what_the_layout_cannot_hold():
  matmuls = layout.matmuls(TINY)
  partial = precision.policy_for("nvfp4_naive", matmuls,
                                 high_precision_paths="layers_0/attn/k_proj")
  with pytest.raises(ValueError, match="partly quantized"):
    hf_quantized.export_policy(TINY, "nvfp4", partial)
  w4a16 = precision.policy_for("nvfp4_w4a16", matmuls)
  with pytest.raises(ValueError, match="rollout_format=nvfp4_w4a16"):
    hf_quantized.export_policy(TINY, "nvfp4", w4a16)
  sr = precision.policy_for("nvfp4_naive", matmuls, stochastic_rounding="all")
  with pytest.raises(ValueError, match="holds bit for bit"):
    hf_quantized.export_policy(TINY, "nvfp4", sr)
  # A run whose sampler does not quantize in the format gets the format's default quantizer.
  bf16 = precision.policy_for("bf16", matmuls)
  default = hf_quantized.export_policy(TINY, "nvfp4", bf16)
  assert default.qdot_config("layers_1/mlp/up_proj").rhs.fmt == "nvfp4"
  assert default.qdot_config("lm_head").rhs is None
