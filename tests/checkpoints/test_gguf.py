"""GGUF checkpoints (lowrl/checkpoints/gguf.py, gguf_tokenizer.py) against transformers' reading of
the same file, on tiny files the tests write with gguf's GGUFWriter (tests/gguf_builders.py):
logits within the FP32 bound of experiments/check_gguf.logit_bound, token ids equal; the q/k
unpermutation, the tokenizer's digit splitting against an independent pipeline, the hooks (config
build, chat template, export files) and the one-line errors.

transformers, torch and accelerate come with the `test` extra (docs/library.md): the comparison
imports them directly, so without them it fails rather than skips.
"""
import os

import jax.numpy as jnp
import numpy as np
import pytest
from gguf_builders import SPECIALS, TINY, permute, train_bpe, write_gguf

from experiments import check_gguf
from lowrl.checkpoints import gguf as lgguf
from lowrl.checkpoints import gguf_tokenizer, hf, packaged
from lowrl.checkpoints.tokenizer import load_tokenizer
from lowrl.tasks.chat_template import ChatTemplate

PROMPTS = check_gguf.PROMPTS[:3]


@pytest.fixture(scope="module")
def tied(tmp_path_factory):
  return write_gguf(tmp_path_factory.mktemp("gguf") / "tied.gguf", tied=True)


@pytest.fixture(scope="module")
def untied(tmp_path_factory):
  return write_gguf(tmp_path_factory.mktemp("gguf") / "untied.gguf", tied=False, seed=1)


@pytest.mark.parametrize("which, chat", [("tied", True), ("untied", False)])
def test_logits_and_ids_match_transformers(request, which, chat):
  path = request.getfixturevalue(which)
  rows = check_gguf.compare(path, PROMPTS, chat=chat)
  for r in rows:
    assert r["ids_equal"], r
    assert r["logit_scale"] > 5.0  # weights large enough for every tensor to matter
    assert r["max_abs_diff"] <= r["bound"], r


def test_without_unpermuting_qk_the_logits_leave_the_bound(tied, monkeypatch):
  """The comparison can fail: llama.cpp's q/k row order read as transformers' moves the logits
  far past the bound."""
  texts = check_gguf.render(tied, PROMPTS[:1], chat=True)
  ids = [load_tokenizer(tied).encode(t) for t in texts]
  _, ref = check_gguf.transformers_side(tied, texts, ids)
  monkeypatch.setattr(lgguf, "unpermute_qk", lambda w, n: w)
  wrong = check_gguf.lowrl_logits(tied, ids)[0]
  cfg = hf.read_checkpoint_config(tied)
  bound = check_gguf.logit_bound(cfg["num_hidden_layers"], cfg["hidden_size"],
                                 cfg["intermediate_size"], len(ids[0]), np.abs(ref[0]).max())
  assert np.abs(wrong - ref[0]).max() > 100 * bound


def test_unpermute_inverts_llama_cpp_permute():
  rng = np.random.default_rng(0)
  for heads, kv in ((4, 4), (4, 2), (9, 3)):
    q = rng.standard_normal((heads * 8, 5))
    k = rng.standard_normal((kv * 8, 5))
    np.testing.assert_array_equal(lgguf.unpermute_qk(permute(q, heads, heads), heads), q)
    np.testing.assert_array_equal(lgguf.unpermute_qk(permute(k, heads, kv), kv), k)
    assert not np.array_equal(permute(q, heads, heads), q)


def test_config_from_metadata(tied, untied):
  cfg = hf.read_checkpoint_config(tied)
  assert cfg["num_hidden_layers"] == TINY["n_layers"] and cfg["hidden_size"] == TINY["d_model"]
  assert cfg["num_key_value_heads"] == TINY["n_kv_heads"] and cfg["head_dim"] == 64
  assert cfg["tie_word_embeddings"] and not hf.read_checkpoint_config(untied)["tie_word_embeddings"]
  model_cfg, params = hf.load_hf_checkpoint(untied)
  assert "lm_head" in params and not model_cfg.tie_embeddings
  assert model_cfg.rms_eps == pytest.approx(TINY["rms_eps"])
  assert model_cfg.max_seq_len == TINY["context"]


def test_smollm_pre_tokenizer_isolates_digits_like_the_original_pipeline(tmp_path):
  """With merges that join digits, "smollm" must still split every digit (llama.cpp's regex
  list "\\p{N}" then GPT-2's): the reference is the original SmolLM2 tokenizer.json's pipeline,
  tokenizers' Digits(individual_digits) + ByteLevel over the same vocabulary and merges."""
  from tokenizers import Tokenizer, models, pre_tokenizers
  path = write_gguf(tmp_path / "digits.gguf", digits_split=False)
  tokens, merges = train_bpe(digits_split=False)
  assert any(m.split(" ")[0].isdigit() and m.split(" ")[1].isdigit() for m in merges)
  ref = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)},
                             merges=[tuple(m.split(" ")) for m in merges]))
  ref.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                               pre_tokenizers.ByteLevel(add_prefix_space=False)])
  ref.add_special_tokens(SPECIALS)
  ours = load_tokenizer(path)
  for text in ("1234567890 99 100 2024", "What is 12 + 345?", "<|im_start|>user\n7*8<|im_end|>"):
    assert ours.encode(text) == ref.encode(text, add_special_tokens=False).ids, text
    assert ours.decode(ours.encode(text), raw=True) == text


def test_gpt2_pre_tokenizer_matches_transformers_on_digit_runs(tmp_path):
  from transformers import AutoTokenizer
  path = write_gguf(tmp_path / "gpt2.gguf", digits_split=False, pre="gpt2")
  theirs = AutoTokenizer.from_pretrained(str(tmp_path), gguf_file="gpt2.gguf")
  ours = load_tokenizer(path)
  for text in ("1234567890 99 100 2024", "hello world, the sea", "<|im_end|> x"):
    assert ours.encode(text) == theirs(text, add_special_tokens=False).input_ids, text


def test_special_tokens_and_chat_template(tied):
  tok = load_tokenizer(tied)
  assert tok.eos_ids == (2,) and tok.pad_id == 2 and tok.bos_id is None  # add_bos_token false
  assert tok.encode("<|im_start|>user")[0] == 1
  template = ChatTemplate.from_checkpoint(tied)
  assert template.render_prompt("hi") == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
  assert template.special_token("eos_token") == "<|im_end|>"


def test_add_bos_token_sets_bos(tmp_path):
  tok = load_tokenizer(write_gguf(tmp_path / "bos.gguf", add_bos=True))
  assert tok.bos_id == 1 and tok.encode("hi", add_special_tokens=True)[0] == 1


def test_export_round_trip(tied, tmp_path):
  """What experiments/export_hf writes for a GGUF source: safetensors (through save_hf_checkpoint,
  the source's config as extra fields) and tokenizer files that load back to the same ids."""
  model_cfg, params = hf.load_hf_checkpoint(tied)
  out = str(tmp_path / "hf")
  hf.save_hf_checkpoint(out, model_cfg, params, extra_config=hf.read_checkpoint_config(tied))
  gguf_tokenizer.write_hf_tokenizer_files(tied, out)
  cfg2, params2 = hf.load_hf_checkpoint(out)
  assert cfg2 == model_cfg
  import jax
  jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)),
               params, params2)
  text = "<|im_start|>user\nWhat is 12 + 345?<|im_end|>"
  assert load_tokenizer(out).encode(text) == load_tokenizer(tied).encode(text)
  assert ChatTemplate.from_checkpoint(out).render_prompt("x") == \
      ChatTemplate.from_checkpoint(tied).render_prompt("x")
  # transformers reads the export: same ids, and logits within the bound of the GGUF's.
  import torch
  from transformers import AutoModelForCausalLM, AutoTokenizer
  ids = load_tokenizer(tied).encode(text)
  assert AutoTokenizer.from_pretrained(out)(text, add_special_tokens=False).input_ids == ids
  model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
  with torch.no_grad():
    theirs = model(torch.tensor([ids])).logits[0].numpy()
  ours = check_gguf.lowrl_logits(tied, [ids])[0]
  bound = check_gguf.logit_bound(model_cfg.n_layers, model_cfg.d_model, model_cfg.d_ff, len(ids),
                                 float(np.abs(theirs).max()))
  assert np.abs(ours - theirs).max() <= bound


def test_bfloat16_load_casts(tied):
  _, params = hf.load_hf_checkpoint(tied, dtype=jnp.bfloat16)
  assert params["embed"]["embedding"].dtype == jnp.bfloat16


@pytest.mark.parametrize("kwargs, match", [
    ({"arch": "gemma"}, "architecture 'gemma' is not supported"),
    ({"tokenizer_model": "llama"}, "tokenizer.ggml.model='llama' is not supported"),
    ({"pre": "chameleon"}, "tokenizer.ggml.pre='chameleon' is not supported"),
    ({"skip": ("blk.1.ffn_up.weight",)}, "lacks 1 tensor"),
])
def test_unsupported_files_are_one_line_errors(tmp_path, kwargs, match):
  path = write_gguf(tmp_path / "bad.gguf", **kwargs)
  with pytest.raises(ValueError, match=match) as e:
    cfg = hf_model_config(path)
    hf.check_hf_weights(path, cfg)
    load_tokenizer(path)
  assert "\n" not in str(e.value)


def test_unsupported_quant_type_and_extra_tensor_are_one_line_errors(tmp_path):
  import gguf
  iq4 = gguf.GGMLQuantizationType.IQ4_XS
  raw = np.zeros((128, gguf.GGML_QUANT_SIZES[iq4][1]), np.uint8)  # [128, 256] in 256-blocks
  path = write_gguf(tmp_path / "iq.gguf", skip=("blk.0.attn_v.weight",),
                    extra={"blk.0.attn_v.weight": (raw, "IQ4_XS")})
  with pytest.raises(ValueError, match="stored as IQ4_XS; lowrl dequantizes"):
    hf.check_hf_weights(path, hf_model_config(path))
  path = write_gguf(tmp_path / "bias.gguf",
                    extra={"blk.0.attn_q.bias": (np.zeros(256, np.float32), None)})
  with pytest.raises(ValueError, match="does not use.*blk.0.attn_q.bias"):
    hf.check_hf_weights(path, hf_model_config(path))


def hf_model_config(path):
  from lowrl.checkpoints.hf_config import model_config_from_hf
  return model_config_from_hf(hf.read_checkpoint_config(path))


def test_training_config_builds_from_a_gguf_file(tied, tmp_path):
  """--config.model.hf_checkpoint=FILE.gguf: the loop's build (no compile) takes the architecture,
  tokenizer and chat template from the file."""
  from configs import base
  from lowrl.training.setup import build
  data = tmp_path / "arith.jsonl"
  data.write_text("".join(f'{{"prompt": "What is {a} + {b}?", "answer": "{a + b}"}}\n'
                          for a in range(10) for b in range(4)))
  cfg = base.get_config()
  cfg.task.name, cfg.task.path, cfg.task.verifier = "jsonl", str(data), "numeric"
  cfg.task.chat_template = True
  cfg.model.hf_checkpoint = tied
  cfg.sft.steps = 0
  cfg.rl.max_new_tokens = 8
  setup = build(cfg)
  assert setup.model_cfg.d_model == TINY["d_model"] and setup.model_cfg.scan_layers
  assert setup.task.tokenizer.eos_ids == (2,)
  prompt = setup.task.sample(np.random.default_rng(0), 1, "train")[0].prompt
  assert prompt.startswith("<|im_start|>user\nWhat is") and prompt.endswith("assistant\n")


def test_missing_shipped_package_is_one_line(monkeypatch):
  with pytest.raises(FileNotFoundError, match="pip install"):
    packaged.package_file("no_such_package_lowrl", "x.gguf", "pip install it")
  assert os.path.basename(packaged.SMOLLM2_FILE).endswith(".gguf")
