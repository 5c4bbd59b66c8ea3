"""config.json as transformers writes it, across versions: the field names of every supported
family read the same, the expert count's two spellings (`num_experts`, `num_local_experts`) both
load, and a save keeps the original's spelling.

tests/data/hf_configs_by_transformers.json holds what `save_pretrained` writes as config.json
(`config.to_json_string(use_diff=True)`) for one tiny config of each family, from transformers
4.57.1 and 5.25.0 (transformers is not a dependency of lowrl; the file was written once with):

  kw = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
  moe = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)
  for mt, extra in [("llama", {}), ("qwen2", {}), ("qwen3", {"head_dim": 16}),
                    ("qwen3_moe", dict(moe, head_dim=16, norm_topk_prob=True)),
                    ("qwen2_moe", dict(moe, shared_expert_intermediate_size=48))]:
    json.loads(AutoConfig.for_model(mt, **kw, **extra).to_json_string(use_diff=True))
"""
import json
import os
import pathlib

import jax
import numpy as np
import pytest

from hf_builders import MOE_CONFIGS, write_checkpoint
from lowrl.checkpoints import (hf_config_from_model, load_hf_checkpoint, model_config_from_hf,
                               save_hf_checkpoint)

_DATA = pathlib.Path(__file__).resolve().parent.parent / "data" / "hf_configs_by_transformers.json"
WRITTEN = json.loads(_DATA.read_text())
OLD, NEW = "4.57.1", "5.25.0"


def test_the_recorded_configs_hold_both_spellings():
  """What the tests below rely on: 5.25 writes num_local_experts for Qwen3-MoE only."""
  assert set(WRITTEN) == {OLD, NEW}
  assert "num_experts" in WRITTEN[OLD]["qwen3_moe"]
  assert "num_local_experts" not in WRITTEN[OLD]["qwen3_moe"]
  assert "num_local_experts" in WRITTEN[NEW]["qwen3_moe"]
  assert "num_experts" not in WRITTEN[NEW]["qwen3_moe"]
  assert "num_experts" in WRITTEN[NEW]["qwen2_moe"]
  assert "rope_parameters" in WRITTEN[NEW]["llama"] and "rope_theta" in WRITTEN[OLD]["llama"]


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3", "qwen3_moe", "qwen2_moe"])
def test_every_family_reads_the_same_from_old_and_new_transformers(family):
  old, new = (model_config_from_hf(WRITTEN[v][family]) for v in (OLD, NEW))
  assert old == new
  assert (new.vocab_size, new.d_model, new.d_ff, new.n_layers, new.n_heads, new.n_kv_heads,
          new.max_seq_len, new.rope_theta) == (64, 32, 48, 2, 4, 2, 256, 10000.0)
  assert new.head_dim == (16 if family.startswith("qwen3") else 8)
  assert new.qk_norm == family.startswith("qwen3")
  assert new.qkv_bias == family.startswith("qwen2")
  if family.endswith("_moe"):
    assert (new.n_experts, new.n_experts_per_tok, new.moe_d_ff) == (4, 2, 32)
    assert new.norm_topk_prob == (family == "qwen3_moe")
    assert new.shared_expert_d_ff == (48 if family == "qwen2_moe" else 0)
  else:
    assert new.n_experts == 0


@pytest.mark.parametrize("version", [OLD, NEW])
def test_a_save_keeps_the_originals_expert_count_spelling(version):
  original = WRITTEN[version]["qwen3_moe"]
  cfg = model_config_from_hf(original)
  saved = hf_config_from_model(cfg, extra=original)
  key = "num_experts" if version == OLD else "num_local_experts"
  other = "num_local_experts" if version == OLD else "num_experts"
  assert saved[key] == 4 and other not in saved
  assert model_config_from_hf(saved) == cfg
  # Without an original, the spelling every transformers version reads.
  assert hf_config_from_model(cfg)["num_experts"] == 4


def test_the_two_spellings_must_agree_and_one_is_required():
  c = dict(WRITTEN[NEW]["qwen3_moe"])
  with pytest.raises(ValueError, match="num_experts=8 and num_local_experts=4 disagree"):
    model_config_from_hf({"num_experts": 8, **c})
  assert model_config_from_hf({"num_experts": 4, **c}).n_experts == 4  # both, equal: fine
  del c["num_local_experts"]
  with pytest.raises(ValueError, match="lacks \\['num_experts or num_local_experts'\\]"):
    model_config_from_hf(c)


def test_qwen2_moe_without_qkv_bias_is_refused():
  with pytest.raises(ValueError, match="qkv_bias=false"):
    model_config_from_hf({**WRITTEN[NEW]["qwen2_moe"], "qkv_bias": False})


def test_a_checkpoint_spelling_num_local_experts_loads_the_same_weights(tmp_path):
  path, _ = write_checkpoint(tmp_path / "a", "qwen3_moe")
  cfg, params = load_hf_checkpoint(path)
  c = dict(MOE_CONFIGS["qwen3_moe"])
  c["num_local_experts"] = c.pop("num_experts")
  with open(os.path.join(path, "config.json"), "w") as fh:
    json.dump(c, fh)
  cfg2, params2 = load_hf_checkpoint(path)
  assert cfg2 == cfg
  for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(params2), strict=True):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  out = str(tmp_path / "saved")
  save_hf_checkpoint(out, cfg2, params2, extra_config=c)
  with open(os.path.join(out, "config.json")) as fh:
    saved = json.load(fh)
  assert saved["num_local_experts"] == 4 and "num_experts" not in saved
