"""`Trainer.policy_kl` (the ablation's twin KL) scores each policy as the distribution its sampler
draws from: naive NVFP4 (tensor-scaled activations) with the static scales it sampled with, not
the batch's amax, so k1 and k3 estimate KL(pi || pi_other) on samples from pi."""
import jax
import numpy as np
import pytest
import tiny

from lowrl import precision
from lowrl.models import init, layout
from lowrl.training import optimizer
from lowrl.training.setup import build
from lowrl.training.trainer import Trainer


def _naive_trainer() -> tuple[Trainer, str]:
  """A tiny naive-NVFP4 trainer and its master dtype."""
  c = tiny.loop_config("nvfp4_naive", "/nonexistent", steps=2)
  c.eval_samples = 4  # 8 held-out prompts x 4 samples: 4 chunks of a rollout's 8 rows
  return Trainer(build(c), log=lambda _: None), c.optimizer.master_dtype


def test_pi_is_scored_with_the_scales_it_sampled_with(monkeypatch):
  trainer, master_dtype = _naive_trainer()
  cfg = trainer.setup.model_cfg
  base = init.init_params(cfg, jax.random.key(0))
  params = trainer.place(optimizer.to_master(base, master_dtype))
  bf16 = precision.policy_for("bf16", layout.matmuls(cfg))
  calls = []
  score = Trainer.score

  def recording(self, p, policy, out, key, **kw):
    logp = score(self, p, policy, out, key, **kw)
    if p is params:  # pi's side (the twin's side scores other params)
      calls.append((out, np.asarray(logp), kw.get("act_amax")))
    return logp

  monkeypatch.setattr(Trainer, "score", recording)
  kl = trainer.policy_kl(params, trainer.place(base), bf16, jax.random.key(1))
  assert len(calls) == 4 and kl["kl_k3"] >= 0
  for out, logp, act_amax in calls:
    comp = np.asarray(out.completion_mask) > 0
    assert comp.sum() > 0
    # The sampler's record is its decode's log q of the tokens it drew. The score is one full
    # forward with the same static scales: the two differ by FP32 reassociation alone (~5e-7
    # measured; no NVFP4 code that close to a rounding boundary here), far below the 1e-4
    # allowed and the ~0.2 nats per token the batch-amax score is off by (checked below).
    np.testing.assert_allclose(logp[comp], np.asarray(out.logprobs)[comp], atol=1e-4)
    assert act_amax is not None
    # The trainer's forward (batch amax) does not score the distribution sampled from.
    batch = np.asarray(score(trainer, params, trainer.setup.trainer_policy, out,
                             jax.random.key(1)))
    assert np.mean(np.abs(batch[comp] - np.asarray(out.logprobs)[comp])) > 1e-2


def test_another_tensor_scaled_policy_is_refused_before_sampling():
  trainer, _ = _naive_trainer()
  other = precision.policy_for("nvfp4_naive", layout.matmuls(trainer.setup.model_cfg),
                               compute_dtype="float32")
  with pytest.raises(ValueError, match="static activation scales"):
    trainer.policy_kl(None, None, other, jax.random.key(0))
