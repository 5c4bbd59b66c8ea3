"""configs/ablate_regime.py builds for every setting and is the regime issue 24 asks for
(completions of >= 64 tokens, d >= 256 with outlier channels each in an NVFP4 block of its own,
>= 300 updates); experiments.regime's cost estimate from timed updates. No JAX programs."""
import pytest

from configs import ablate_regime
from experiments import ablate, regime
from lowrl.training import outliers
from lowrl.training.setup import build


def test_regime_builds_and_meets_the_issue():
  cfg = ablate_regime.get_config()
  pairs = ablate.validate(cfg)  # every setting's loop config builds (one-line errors otherwise)
  setup = build(pairs[0][1])
  task = setup.task
  assert task.min_len + 1 >= 64 and setup.sampling.max_new_tokens >= task.max_answer_len
  assert setup.model_cfg.d_model >= 256 and setup.loop.steps * setup.loop.updates_per_step >= 300
  ch = outliers.channels(setup.model_cfg.d_model, setup.base.outliers[0])
  assert len(ch) >= 2 and len({c // 16 for c in ch}) == len(ch)
  assert setup.loop.keep_steps == (75, 150) and setup.loop.code_churn
  # The dynamic claims' settings (the twin, naive NVFP4, the recipe), at least 5 seeds each.
  assert [s.name for s, _ in pairs] == ["bf16", "nvfp4_naive", "nvfp4_recipe"]
  assert len(cfg.seeds) >= 5 and all(s.seeds(tuple(cfg.seeds)) == tuple(cfg.seeds)
                                     for s, _ in pairs)
  # The prompt is short beside the completion: most of a forward pass is the completion.
  assert task.max_prompt_len < task.max_answer_len


def test_estimate_counts_settings_seeds_and_updates():
  cfg = ablate_regime.get_config()
  timing = {"bf16": {"rl_step_s": 10.0, "sft_step_s": 2.0},
            "nvfp4_naive": {"rl_step_s": 30.0, "sft_step_s": None},
            "nvfp4_recipe": {"rl_step_s": 20.0, "sft_step_s": None}}
  e = regime.estimate(cfg, timing)
  n = len(ablate.settings(cfg))
  runs_s = len(cfg.seeds) * 300 * (10.0 + (n - 1) * 25.0)
  assert e["rl_hours"] == pytest.approx(runs_s / 3600)
  assert e["sft_hours"] == pytest.approx(cfg.run.sft.steps * 2.0 / 3600)


def test_quick_regime_is_the_same_grid_small():
  """`--config.quick=True` on the regime: the twin and the recipe on 2 seeds, the regime's model
  and task, a base of at most QUICK_SFT_STEPS (1000 at d = 256 alone exceeds the quick budget),
  no after-run held-out passes (as the full regime); every setting builds."""
  full = ablate_regime.get_config()
  q = ablate.quick(full)
  pairs = ablate.validate(q)
  assert [s.name for s, _ in pairs] == ["bf16", "nvfp4_recipe"] and tuple(q.seeds) == (0, 1)
  assert q.run.sft.steps == ablate.QUICK_SFT_STEPS < full.run.sft.steps
  assert q.run.model.d_model == full.run.model.d_model and q.run.task.name == full.run.task.name
  assert tuple(q.after_run) == tuple(full.after_run) == ()
