"""experiments.export_hf: a tiny 2-step run exported as a Hugging Face checkpoint loads back with
the trainer's params and logits bit for bit; the ModelOpt NVFP4 / MXFP8 rollout layout decodes
(by an independent reading of the documented bytes) to lowrl's fake_quant of the kernels."""
import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import orbax.checkpoint as ocp
import pytest
import tiny

from experiments import export_hf
from lowrl import precision
from lowrl.checkpoints import hf_quantized, load_hf_checkpoint
from lowrl.models import layout, transformer
from lowrl.quant.config import QuantConfig
from lowrl.quant.quantize import fake_quant
from lowrl.sampling import weights
from lowrl.training import loop
from lowrl.training.setup import build

STEPS = 2
# E2M1 magnitudes by the low 3 bits of a nibble (OCP MX spec); bit 3 is the sign.
_E2M1 = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], np.float32)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
  base = str(tmp_path_factory.mktemp("base"))
  workdir = str(tmp_path_factory.mktemp("run"))
  cfg = tiny.loop_config("fp32", base, steps=STEPS)
  loop.run(cfg, workdir, log=lambda _: None)
  return workdir, build(cfg).model_cfg


def _saved_params(workdir: str, step: int):
  """The params a checkpoint holds, read whole by orbax (no partial restore, no abstract tree)."""
  state = ocp.PyTreeCheckpointer().restore(os.path.join(workdir, "checkpoints", str(step), "state"))
  return jax.tree.map(np.asarray, state["params"])


def _logits(params, model_cfg):
  tokens = jnp.arange(12, dtype=jnp.int32).reshape(2, 6) % model_cfg.vocab_size
  policy = precision.policy_for("fp32", layout.matmuls(model_cfg))
  return transformer.forward(params, tokens, model_cfg, policy)


def test_export_loads_back_bit_for_bit(run, tmp_path):
  workdir, model_cfg = run
  logs = []
  info = export_hf.export(workdir, str(tmp_path / "hf"), log=logs.append)
  assert info["step"] == STEPS and info["tokenizer_files"] == []
  assert any("character tokenizer" in m and "none written" in m for m in logs)
  loaded_cfg, params = load_hf_checkpoint(tmp_path / "hf")
  assert loaded_cfg == model_cfg
  want = _saved_params(workdir, STEPS)
  jax.tree.map(np.testing.assert_array_equal, jax.tree.map(np.asarray, params), want)
  np.testing.assert_array_equal(_logits(params, model_cfg), _logits(want, model_cfg))
  assert sorted(os.listdir(tmp_path / "hf")) == ["config.json", "model.safetensors"]


def test_export_chosen_step_and_errors(run, tmp_path):
  workdir, model_cfg = run
  export_hf.export(workdir, str(tmp_path / "s1"), step=1, log=lambda _: None)
  _, params = load_hf_checkpoint(tmp_path / "s1")
  jax.tree.map(np.testing.assert_array_equal, jax.tree.map(np.asarray, params),
               _saved_params(workdir, 1))
  with pytest.raises(export_hf.ExportError, match=r"--step=7 is not among .*\[1, 2\]"):
    export_hf.export(workdir, str(tmp_path / "s7"), step=7, log=lambda _: None)
  with pytest.raises(export_hf.ExportError, match="--overwrite"):
    export_hf.export(workdir, str(tmp_path / "s1"), log=lambda _: None)
  with pytest.raises(export_hf.ExportError, match="config.json not found"):
    export_hf.export(str(tmp_path), str(tmp_path / "x"), log=lambda _: None)
  with pytest.raises(export_hf.ExportError, match="rollout_format"):
    export_hf.export(workdir, str(tmp_path / "y"), rollout_format="fp8", log=lambda _: None)


def test_cli_bad_input_is_one_line_exit_2(tmp_path):
  proc = subprocess.run([sys.executable, "-m", "experiments.export_hf", f"--workdir={tmp_path}",
                         f"--out={tmp_path / 'out'}"], capture_output=True, text=True,
                        cwd=str(tiny.REPO))
  assert proc.returncode == 2, proc.stderr
  assert proc.stderr.strip().count("\n") == 0 and "config.json not found" in proc.stderr


def _decode_nvfp4(t):
  """Reference decoding of the ModelOpt NVFP4 bytes: element 2j in the low nibble of byte j."""
  packed = t["weight"]
  nib = np.stack([packed & 0xF, packed >> 4], axis=-1).reshape(packed.shape[0], -1)
  val = _E2M1[nib & 7] * np.where(nib & 8, -1.0, 1.0).astype(np.float32)
  block = np.repeat(t["weight_scale"].astype(np.float32), 16, axis=1)
  return (val * block) * t["weight_scale_2"]


def _decode_mxfp8(t):
  block = np.repeat(np.ldexp(np.float32(1), t["weight_scale"].astype(np.int32) - 127), 32, axis=1)
  return t["weight"].astype(np.float32) * block


@pytest.mark.parametrize("fmt,algo", [("nvfp4", "NVFP4"), ("nvfp4_w4a16", "W4A16_NVFP4"),
                                      ("mxfp8", "MXFP8")])
def test_rollout_layout_round_trip(run, tmp_path, fmt, algo):
  workdir, model_cfg = run
  out = tmp_path / fmt
  export_hf.export(workdir, str(out), rollout_format=fmt, log=lambda _: None)
  tensors = hf_quantized.read_safetensors(out / "model.safetensors")
  params = _saved_params(workdir, STEPS)
  config = json.loads((out / "config.json").read_text())
  assert config["quantization_config"] == {
      "quant_method": "modelopt", "quant_algo": algo, "group_size": 32 if fmt == "mxfp8" else 16,
      "kv_cache_quant_algo": None, "ignore": ["lm_head"]}
  modelopt = json.loads((out / "hf_quant_config.json").read_text())["quantization"]
  assert modelopt["quant_algo"] == algo and modelopt["exclude_modules"] == ["lm_head"]
  # The fp32 run's sampler quantizes nothing: the format's default weight quantizer, applied as a
  # sampler applies it (the [in, out] kernel blocked along its contracting axis 0; NVFP4's fused
  # q/k/v and gate/up with their joint amax, tests/checkpoints/test_hf_quantized.py).
  policy = hf_quantized.export_policy(model_cfg, fmt, None)
  assert policy.qdot_config("layers_0/attn/q_proj").rhs == QuantConfig(
      "mxfp8_e4m3" if fmt == "mxfp8" else "nvfp4")
  sampler_params, _ = weights.quantize_weights(jax.tree.map(jnp.asarray, params), model_cfg,
                                               policy)
  for m in layout.matmuls(model_cfg):
    if m.layer is None:
      continue
    t = {k.removeprefix(m.hf_name + "."): v for k, v in tensors.items()
         if k.startswith(m.hf_name + ".")}
    want = np.asarray(layout.get_param(sampler_params, m.param_keys)).T
    if fmt != "mxfp8":
      assert t["weight"].dtype == np.uint8 and t["weight"].shape == (m.out_features, m.in_features // 2)
      assert t["weight_scale"].dtype == ml_dtypes.float8_e4m3fn
      assert t["weight_scale"].shape == (m.out_features, m.in_features // 16)
      assert t["weight_scale_2"].shape == (1,)
      if fmt == "nvfp4":
        assert t["input_scale"].shape == (1,) and t["input_scale"] > 0
      else:  # weight-only: activations unquantized, no input scale
        assert "input_scale" not in t
      got = _decode_nvfp4(t)
    else:
      assert t["weight"].dtype == ml_dtypes.float8_e4m3fn and t["weight_scale"].dtype == np.uint8
      assert t["weight_scale"].shape == (m.out_features, m.in_features // 32)
      got = _decode_mxfp8(t)
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(hf_quantized.dequantize_linear(t, fmt), want)
  # Everything else is the plain export's tensors.
  np.testing.assert_array_equal(tensors["model.embed_tokens.weight"], params["embed"]["embedding"])
  np.testing.assert_array_equal(tensors["model.norm.weight"], params["final_norm"]["scale"])


def test_nvfp4_input_scale_and_nibble_order():
  # One row [6, -0.5, 0..0] (amax 6): outer = 6/(6*448), block scale = 448, codes 6 and -0.5:
  # byte 0 = 0b1001_0111 (low nibble 0x7 = +6, element 0; high 0x9 = -0.5, element 1).
  w = np.zeros((1, 16), np.float32)
  w[0, :2] = [6.0, -0.5]
  t = hf_quantized.quantize_linear(w, "nvfp4", input_amax=2688.0)
  assert t["weight"][0, 0] == 0x97 and not t["weight"][0, 1:].any()
  assert t["input_scale"] == np.float32(1.0) and t["input_scale"].shape == (1,)  # amax / 2688
  assert t["weight_scale"][0, 0] == 448 and t["weight_scale_2"] == np.float32(6.0 / 2688.0)
  # (outer = RNE(6/2688) is inexact, so the decoded 6 is 6 * 448 * outer, as fake_quant's.)
  np.testing.assert_array_equal(_decode_nvfp4(t), fake_quant(jnp.asarray(w), QuantConfig("nvfp4")))
  with pytest.raises(ValueError, match="input amax"):
    hf_quantized.quantize_linear(w, "nvfp4")
  with pytest.raises(ValueError, match="divisible by 32"):
    hf_quantized.quantize_linear(w, "mxfp8")


def test_copy_tokenizer_files(tmp_path):
  src, out = tmp_path / "src", tmp_path / "out"
  src.mkdir(), out.mkdir()
  for name in ("tokenizer.json", "tokenizer_config.json", "model.safetensors"):
    (src / name).write_text(name)
  assert export_hf.copy_tokenizer_files(str(src), str(out)) == ["tokenizer.json",
                                                                "tokenizer_config.json"]
  assert (out / "tokenizer_config.json").read_text() == "tokenizer_config.json"
  os.remove(src / "tokenizer.json")
  with pytest.raises(export_hf.ExportError, match="no tokenizer.json"):
    export_hf.copy_tokenizer_files(str(src), str(out))


def test_a_run_saved_before_newer_knobs_exports_as_it_ran(run, tmp_path):
  """A config.json without the knobs added since (precision.act_format / weight_scales,
  refit_check_every) reads back with the behaviour the run had: one scale per linear."""
  import shutil
  workdir, _ = run
  old = tmp_path / "old"
  shutil.copytree(workdir, old)
  saved = json.loads((old / "config.json").read_text())
  for k in ("act_format", "weight_scales"):
    del saved["config"]["precision"][k]
  del saved["config"]["refit_check_every"]
  (old / "config.json").write_text(json.dumps(saved))
  cfg = export_hf.run_config_of(str(old))
  assert cfg.precision.weight_scales == "per_linear" and cfg.precision.act_format == ""
  assert cfg.refit_check_every == 1
  export_hf.export(str(old), str(tmp_path / "out"), log=lambda _: None)
