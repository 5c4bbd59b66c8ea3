"""The training loop from tiny Qwen3-MoE / Qwen2-MoE checkpoints (tests/hf_builders.py) on the
JSONL task: 2 RL steps on an expert-parallel (data 2, expert 4, model 1) mesh of the 8 fake
devices, for Qwen3-MoE under FP32 with the same discrete metrics on one device, for Qwen2-MoE
(shared expert) under the routed-expert recipe nvfp4_moe_experts; the FP32 run is exported back
to Hugging Face. Setup and tolerances as tests/training/test_hf_loop.py."""
import jax
import pytest

from hf_builders import write_checkpoint, write_tokenizer
from lowrl import sharding
from lowrl.checkpoints import load_hf_checkpoint
from experiments import export_hf
from lowrl.training import loop
from lowrl.training.setup import build
from test_hf_loop import _config, _max_abs_diff, _metrics, assert_same_run  # also the verifier


@pytest.fixture(scope="module")
def files(tmp_path_factory):
  root = tmp_path_factory.mktemp("hf_moe")
  dirs = {}
  for family in ("qwen3_moe", "qwen2_moe"):
    dirs[family], _ = write_checkpoint(root, family)
    write_tokenizer(dirs[family], "qwen")
  jsonl = root / "math.jsonl"
  jsonl.write_text("".join(f'{{"prompt": "what is {a} + {b} =", "answer": {a + b}}}\n'
                           for a in (1, 2, 3, 4, 7) for b in (1, 2, 3, 4, 7, 12)))
  return dirs, str(jsonl)


def _moe_config(files, family, recipe, **overrides):
  c = _config(files, family, **overrides)
  c.task.chat_template = False
  if recipe != "fp32":
    from configs import base as base_config
    c.precision = base_config.get_config(recipe).precision
  c.mesh.axes, c.mesh.shape = ("data", sharding.EXPERT, "model"), (2, 4, 1)
  c.mesh.rules = sharding.expert_parallel_rules()
  c.mesh.batch_axes = ("data", sharding.EXPERT)
  for k, v in overrides.items():
    section, _, knob = k.rpartition(".")
    (c[section] if section else c)[knob] = v
  return c


@pytest.mark.parametrize("family, recipe", [("qwen3_moe", "fp32"),
                                            ("qwen2_moe", "nvfp4_moe_experts")])
def test_two_rl_steps_from_moe_checkpoint(files, family, recipe, tmp_path, monkeypatch):
  cfg = _moe_config(files, family, recipe)
  setup = build(cfg)
  assert setup.model_cfg.is_moe
  assert dict(setup.plan.mesh.shape) == {"data": 2, "expert": 4, "model": 1}
  loop.run(cfg, str(tmp_path / "mesh"), log=lambda _: None)
  mesh = _metrics(tmp_path / "mesh")
  assert [m["step"] for m in mesh] == [1, 2]
  assert any(m["grad_norm"] > 0 for m in mesh)
  if family == "qwen3_moe":
    make = sharding.plan_from_config
    monkeypatch.setattr(sharding, "plan_from_config",
                        lambda m, devices=None: make(m, jax.devices()[:1]))
    loop.run(_moe_config(files, family, recipe, **{"mesh.shape": (1, 1, 1)}),
             str(tmp_path / "one"), log=lambda _: None)
    assert_same_run(mesh, _metrics(tmp_path / "one"))
  else:
    return  # export_hf rebuilds on every local device of the data axis: D = 32 / 8 < a block
  dirs, _ = files
  export_hf.export(str(tmp_path / "mesh"), str(tmp_path / "hf_out"), log=lambda _: None)
  exported_cfg, exported = load_hf_checkpoint(tmp_path / "hf_out")
  source_cfg, source = load_hf_checkpoint(dirs[family])
  assert exported_cfg == source_cfg
  assert 0 < max(jax.tree.leaves(jax.tree.map(_max_abs_diff, exported, source)))
