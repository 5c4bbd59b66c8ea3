"""The real-checkpoint path of the training loop: `--config.model.hf_checkpoint` with a JSONL task
chosen by flags, from tiny Qwen2 (tied embeddings, qkv bias, BF16), Qwen3 (q/k norm, head_dim !=
d_model / n_heads, sharded index, chat template) and Llama (llama3 RoPE scaling) checkpoints that
tests/hf_builders.py writes; 2 RL steps of each family on a (4, 2) mesh of the 8 fake devices train
the policy and export back to the source's architecture and tokenizer files, and for Qwen3 (the
family with the most features) the same 2 steps on one device give the same metrics (mesh against
one device for the tiny model: tests/test_sharding.py); every eos id of the checkpoint stops
generation; flag errors come before any compile."""
import dataclasses
import json

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest
import safetensors.numpy

from configs import base as base_config
from experiments import export_hf
from hf_builders import write_checkpoint, write_tokenizer
from lowrl import sharding
from lowrl.checkpoints import load_hf_checkpoint, load_hf_params, load_tokenizer
from lowrl.sampling import generate
from lowrl.tasks import verifiers
from lowrl.training import loop
from lowrl.training.setup import build

# ChatML, as Qwen writes it (no system message).
CHATML = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + "
          "'<|im_end|>\\n' }}{% endfor %}{% if add_generation_prompt %}"
          "{{ '<|im_start|>assistant\\n' }}{% endif %}")
# family -> tokenizer style, tokenizer_config.json extras (the Qwen3 one carries a chat template).
TOKENIZERS = {"qwen2": ("qwen", {}), "qwen3": ("qwen", {"chat_template": CHATML}),
              "llama": ("llama", {})}
# The eos ids each checkpoint's files name (hf_builders.TOKENIZER_FILES and HF_CONFIGS, written
# out): Qwen's tokenizer_config eos <|im_end|> = 3, generation_config's [3, 1], config.json's 2;
# Llama's </s> = 2, then generation_config's and config.json's [2, 3].
EOS_IDS = {"qwen2": (3, 1, 2), "qwen3": (3, 1, 2), "llama": (2, 3)}

# Random tiny weights never produce the answer, so every group's rewards would be equal and the
# advantages exactly 0 (no update to compare). This verifier adds partial credit for the
# completion's length in characters (< 1; the answer itself scores 1): the groups' rewards differ
# and the update moves the weights.
verifiers.register_verifier(
    "test_length_credit",
    lambda: lambda completion, answer: (1.0 if completion.strip() == answer.strip()
                                        else min(len(completion), 15) / 16),
    overwrite=True)


@pytest.fixture(scope="module")
def files(tmp_path_factory):
  """{family: checkpoint dir} and the JSONL file (prompt/answer lines over the BPE corpus)."""
  root = tmp_path_factory.mktemp("hf")
  dirs = {}
  for family, (style, extra) in TOKENIZERS.items():
    dirs[family], _ = write_checkpoint(root, family)
    write_tokenizer(dirs[family], style, **extra)
  jsonl = root / "math.jsonl"
  with open(jsonl, "w") as f:
    for a in (1, 2, 3, 4, 7):
      for b in (1, 2, 3, 4, 7, 12):
        f.write(json.dumps({"prompt": f"what is {a} + {b} =", "answer": a + b}) + "\n")
  return dirs, str(jsonl)


def _config(files, family, **overrides):
  dirs, jsonl = files
  c = base_config.get_config("fp32")
  c.model.hf_checkpoint = dirs[family]
  c.task.name, c.task.path, c.task.verifier = "jsonl", jsonl, "test_length_credit"
  c.task.kwargs = ml_collections.ConfigDict({"eval_fraction": 0.25})
  c.task.chat_template = family == "qwen3"
  c.sft.steps = 0
  c.rl.update(steps=2, num_prompts=2, group_size=4, max_new_tokens=4)
  # 8 eval rows, as the rollout's: the temperature-1 eval reuses the rollout's decode program.
  c.eval_num_prompts, c.eval_samples, c.num_text_samples = 8, 1, 0
  c.rl.log_kl_ref = False
  c.mesh.shape = (4, 2)
  for k, v in overrides.items():
    section, _, knob = k.rpartition(".")
    (c[section] if section else c)[knob] = v
  return c


def _metrics(workdir) -> list[dict]:
  with open(workdir / "metrics.jsonl") as f:
    return [json.loads(line) for line in f]


# Discrete metrics (sampled tokens, rewards, lengths): equal on any mesh unless a sampled token
# flips, which the FP32 differences below cannot cause except within ~1e-6 of a decision boundary.
DISCRETE = ("reward/mean", "reward/pass_rate", "response_length", "groups_kept",
            "sampler_version_lag", "versions_held", "skipped_updates")


def assert_same_run(mesh: list[dict], one: list[dict]) -> None:
  """The metrics of a run on a mesh and on one device: discrete ones equal, the rest close."""
  for a, b in zip(mesh, one):
    assert a.keys() == b.keys()
    for k in a:
      if k in DISCRETE:
        assert a[k] == b[k], k
      else:
        # Tolerance: the mesh reassociates FP32 sums (matmul contractions split over "data" and
        # "model", cross-device reductions of the loss and gradient norms) of at most ~100
        # terms, each within gamma_100 ~ 6e-6 relative of the exact sum; through 2 layers, the
        # softmax, the loss and 2 Adam steps that stays below 1e-4 relative; abs 1e-6 for values
        # near 0 (the same bound tests/test_distributed.py uses for reordered sums). Not
        # bit-exact: the split contractions round differently.
        assert a[k] == pytest.approx(b[k], rel=1e-4, abs=1e-6), k


def _max_abs_diff(a, b) -> float:
  """max |a - b| with b cast to a's dtype, on the host (as jax ops: ~60 tiny eager programs)."""
  a = np.asarray(a)
  b = np.asarray(b).astype(a.dtype)
  return float(np.abs(a.astype(np.float32) - b.astype(np.float32)).max())


@pytest.mark.parametrize("family", TOKENIZERS)
def test_two_rl_steps_from_checkpoint_on_a_mesh_and_for_qwen3_on_one_device(files, family,
                                                                           tmp_path, monkeypatch):
  mesh_cfg = _config(files, family)
  setup = build(mesh_cfg)
  assert setup.model_cfg.scan_layers  # on by default for a checkpoint
  assert dict(setup.plan.mesh.shape) == {"data": 4, "model": 2}
  mesh_summary = loop.run(mesh_cfg, str(tmp_path / "mesh"), log=lambda _: None)
  mesh = _metrics(tmp_path / "mesh")
  assert [m["step"] for m in mesh] == [1, 2]
  # The groups' rewards differ, so the update moved the weights (a real comparison).
  assert any(m["grad_norm"] > 0 for m in mesh)

  # One device, for Qwen3 only (the family with the most features: q/k norm, head_dim != d_model /
  # n_heads, sharded index, chat template); Qwen2 and Llama add their loading and architecture,
  # which the mesh run exercises. The same config on a 1x1 mesh of the first device.
  if family == "qwen3":
    make = sharding.plan_from_config
    monkeypatch.setattr(sharding, "plan_from_config",
                        lambda m, devices=None: make(m, jax.devices()[:1]))
    one_summary = loop.run(_config(files, family, **{"mesh.shape": (1, 1)}),
                           str(tmp_path / "one"), log=lambda _: None)
    one = _metrics(tmp_path / "one")
    assert [m["step"] for m in one] == [1, 2]
    assert any(m["grad_norm"] > 0 for m in one)
    assert_same_run(mesh, one)
    for key in ("greedy", "pass_at_1"):  # evaluation rewards: discrete
      assert mesh_summary["eval_end"][key] == one_summary["eval_end"][key]

  # Back to a Hugging Face checkpoint: the source's architecture and tokenizer files.
  dirs, _ = files
  info = export_hf.export(str(tmp_path / "mesh"), str(tmp_path / "hf_out"), log=lambda _: None)
  assert info["step"] == 2 and "tokenizer.json" in info["tokenizer_files"]
  exported_cfg, exported = load_hf_checkpoint(tmp_path / "hf_out")
  source_cfg, source = load_hf_checkpoint(dirs[family])
  assert exported_cfg == source_cfg
  assert load_tokenizer(tmp_path / "hf_out").eos_ids == EOS_IDS[family]
  moved = jax.tree.map(_max_abs_diff, exported, source)
  assert 0 < max(jax.tree.leaves(moved))  # the trained policy, not the source


def test_build_reads_the_checkpoint(files):
  dirs, _ = files
  setup = build(_config(files, "llama", **{"model.param_dtype": "bfloat16"}))
  m = setup.model_cfg
  assert (m.vocab_size, m.d_model, m.n_heads, m.head_dim, m.max_seq_len) == (90, 48, 6, 8, 512)
  assert m.rope_llama3_scaling == (8.0, 1.0, 4.0, 32)
  assert setup.task.tokenizer.eos_ids == EOS_IDS["llama"]
  # The tiny path keeps scan_layers off by default; an explicit False holds for a checkpoint.
  unscanned = build(_config(files, "llama", **{"model.scan_layers": False}))
  assert not unscanned.model_cfg.scan_layers
  # The chat template renders every prompt (Qwen3 run): one user message + the assistant header.
  qwen3 = build(_config(files, "qwen3"))
  for e in qwen3.task.examples("train"):
    raw = e.metadata["raw_prompt"]
    assert e.prompt == f"<|im_start|>user\n{raw}<|im_end|>\n<|im_start|>assistant\n"


@pytest.mark.parametrize("family", EOS_IDS)
def test_every_eos_id_of_the_checkpoint_stops_generation(files, family):
  setup = build(_config(files, family))
  assert setup.sampling.stop_tokens == EOS_IDS[family]
  assert setup.eval_sampling.stop_tokens == EOS_IDS[family]
  if family == "qwen3":  # one decode per tokenizer style is enough
    return
  # The sampler stops a row at the first of *any* stop id. Reference: the greedy completion without
  # stops, cut at the first position holding one of two stop ids taken from different rows.
  dirs, _ = files
  params = load_hf_params(dirs[family], setup.model_cfg)
  tok = load_tokenizer(dirs[family])
  prompts = ["what is 3 + 4 =", "the cat sat on", "a dog ate 12", "the answer is"]
  ids = [[tok.bos_id] * (tok.bos_id is not None) + tok.encode(p) for p in prompts]
  width = max(map(len, ids))
  tokens = np.array([[0] * (width - len(r)) + r for r in ids], np.int32)  # left-padded
  mask = np.array([[0] * (width - len(r)) + [1] * len(r) for r in ids], np.float32)
  greedy = dataclasses.replace(setup.eval_sampling, max_new_tokens=6, stop_tokens=())
  kw = dict(model_cfg=setup.model_cfg, policy=setup.trainer_policy)
  free, _ = generate(params, jnp.asarray(tokens), jnp.asarray(mask), jax.random.key(0),
                     config=greedy, **kw)
  free_N = np.asarray(free.tokens)[:, width:]

  def cut(stops):  # reference: completion lengths, each row cut after its first stop id
    return [next((t + 1 for t in range(free_N.shape[1]) if free_N[b, t] in stops),
                 free_N.shape[1]) for b in range(len(prompts))]

  # Two stop ids from different rows, such that rows end on each of them.
  stops = next((a, b) for a in free_N[0] for b in free_N[1] if a != b
               and {free_N[r, n - 1] for r, n in enumerate(cut((a, b)))} >= {a, b})
  stops = tuple(map(int, stops))
  out, _ = generate(params, jnp.asarray(tokens), jnp.asarray(mask), jax.random.key(0),
                    config=dataclasses.replace(greedy, stop_tokens=stops), **kw)
  got_N, live_N = np.asarray(out.tokens)[:, width:], np.asarray(out.completion_mask)[:, width:]
  for b, n in enumerate(cut(stops)):
    np.testing.assert_array_equal(got_N[b, :n], free_N[b, :n])  # the stop token is kept
    assert live_N[b].tolist() == [1.0] * n + [0.0] * (free_N.shape[1] - n)
    assert (got_N[b, n:] == greedy.pad_id).all()


@pytest.mark.parametrize("overrides, match", [
    ({"task.chat_template": True, "model.hf_checkpoint": ""},
     r"task.chat_template=True .* set --config.model.hf_checkpoint"),
    ({"task.chat_template": True}, r"--config.task.chat_template: .* no chat_template"),
    ({"sft.steps": 10}, r"--config.sft.steps=10: .* set --config.sft.steps=0"),
    ({"model.d_model": 64}, r"--config.model.d_model=64 does not apply with"),
    ({"model.hf_checkpoint": "/nonexistent"}, r"hf_checkpoint=/nonexistent: .*not found"),
    ({"rl.max_new_tokens": 200}, r"max_position_embeddings is 128; lower --config.rl.max_new_"),
    ({"model.param_dtype": "float16"}, r"param_dtype='float16': use one of"),
    ({"model.param_dtype": "bfloat16", "model.hf_checkpoint": ""},
     r"param_dtype='bfloat16' applies to --config.model.hf_checkpoint only"),
])
def test_flag_errors_before_any_compile(files, overrides, match):
  cfg = _config(files, "qwen2", **overrides)
  with pytest.raises(ValueError, match=match):
    build(cfg)


def test_task_needs_jsonl_and_bad_weights_are_reported(files, tmp_path):
  cfg = _config(files, "qwen2", **{"task.name": "addition", "task.path": "", "task.verifier": "",
                                   "task.kwargs": ml_collections.ConfigDict()})
  with pytest.raises(ValueError, match=r"needs a task in the checkpoint's tokenizer"):
    build(cfg)
  # A weight of the wrong shape: found from the safetensors header by build(), before any compile.
  path, tensors = write_checkpoint(tmp_path, "qwen2")
  write_tokenizer(path, "qwen")
  tensors["model.norm.weight"] = tensors["model.norm.weight"][:-1]
  safetensors.numpy.save_file(tensors, f"{path}/model.safetensors", metadata={"format": "pt"})
  with pytest.raises(ValueError, match=r"hf_checkpoint=.*'model.norm.weight' has shape \(31,\)"):
    build(_config(files, "qwen2", **{"model.hf_checkpoint": path}))
