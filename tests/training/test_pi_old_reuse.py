"""The exact-mode sampler's record reused as the trainer's pi_old (`Trainer.sampler_scored_pi_old`):
only where it is provably the trainer's own score, and with the metrics of the rescoring run."""
import os

import jax
import pytest
import tiny

from lowrl.training import loop
from lowrl.training.setup import build
from lowrl.training.trainer import Trainer


def _trainer(recipe: str = "bf16", **overrides) -> Trainer:
  c = tiny.loop_config(recipe, "/nonexistent", steps=2)
  for key, value in overrides.items():
    section, _, knob = key.rpartition(".")
    (c[section] if section else c)[knob] = value
  return Trainer(build(c), log=lambda _: None)


def _params(trainer):
  return trainer.place(jax.tree.map(lambda s: jax.numpy.zeros(s.shape, s.dtype),
                                    trainer.param_shapes))


@pytest.mark.parametrize("recipe, overrides, expected", [
    ("bf16", {}, True),
    ("nvfp4_recipe", {}, True),  # the default recipe: per-token activation scales
    ("bf16", {"sampler_exact": False}, False),  # the sampler records its decode logprobs
    ("bf16", {"sampler_precision.recipe": "nvfp4_recipe"}, False),  # another policy
    # Tensor-scaled activations: the sampler uses static calibrated scales, the trainer the batch.
    ("nvfp4_naive", {}, False),
])
def test_reused_only_for_the_trainers_own_program(recipe, overrides, expected):
  trainer = _trainer(recipe, **overrides)
  params = _params(trainer)
  assert trainer.sampler_scored_pi_old(params, params, stale=False) is expected
  # Stale weights, or the same values in other buffers (a version copy), are always re-scored.
  assert not trainer.sampler_scored_pi_old(params, params, stale=True)
  copy = jax.tree.map(lambda x: x + 0, params)
  assert not trainer.sampler_scored_pi_old(copy, params, stale=False)


def _run(base_dir, workdir, monkeypatch, force_rescore: bool) -> tuple[bytes, int]:
  """A tiny exact-mode run (sampler = trainer = bf16, lag 0): metrics.jsonl and the number of
  trainer scoring passes."""
  calls = []
  score = Trainer.score

  def counting(self, *args, **kwargs):
    calls.append(1)
    return score(self, *args, **kwargs)

  with monkeypatch.context() as m:
    m.setattr(Trainer, "score", counting)
    if force_rescore:  # the code before the reuse: every step scores again
      m.setattr(Trainer, "sampler_scored_pi_old", lambda *a, **k: False)
    loop.run(tiny.loop_config("bf16", str(base_dir), steps=3), str(workdir), log=lambda _: None)
  with open(os.path.join(workdir, "metrics.jsonl"), "rb") as f:
    return f.read(), len(calls)


def test_reuse_skips_the_pass_and_leaves_metrics_byte_identical(tmp_path, monkeypatch):
  reused, n_reused = _run(tmp_path / "base", tmp_path / "reused", monkeypatch, False)
  rescored, n_rescored = _run(tmp_path / "base", tmp_path / "rescored", monkeypatch, True)
  assert n_reused == 0 and n_rescored == 3  # one pi_old pass per step, none when reused
  assert reused == rescored
  for line in reused.decode().splitlines():  # the sampler is the trainer: no mismatch at all
    assert '"mismatch/mismatch_kl": 0.0,' in line and '"mismatch/abs_dlogp_max": 0.0,' in line
