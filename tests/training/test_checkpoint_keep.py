"""checkpoint_keep_fractions: the kept steps (round half up, at least 1) survive rotation beside
the newest `max_to_keep`, restore like any other, and leave a run's fingerprint alone (a knob
of what is kept, not of what is trained)."""
import jax.numpy as jnp
import numpy as np
import pytest
import tiny

from lowrl.training import run_config
from lowrl.training.checkpointing import Checkpointer, abstract_like
from lowrl.training.setup import build, keep_steps


def test_keep_steps_round_half_up_distinct_and_at_least_one():
  assert keep_steps((0.25, 0.5), 30) == (8, 15)  # 7.5 -> 8 (Python's round() would give 8 too)
  assert keep_steps((0.5, 0.25), 10) == (3, 5)  # 2.5 -> 3 (round() gives 2)
  assert keep_steps((0.01, 0.02, 1.0), 10) == (1, 10)
  assert keep_steps((), 10) == ()


def test_kept_steps_survive_rotation_and_restore(tmp_path):
  ckpt = Checkpointer(str(tmp_path / "c"), every=2, max_to_keep=2, keep=(3,))
  tree = lambda s: {"w": jnp.full((3,), float(s))}  # noqa: E731
  for s in range(1, 9):
    ckpt.save(s, tree(s), {"step": s}, force=s == 3)
  ckpt.wait()
  # Saved: 2, 3 (forced), 4, 6, 8; rotation keeps the newest two (6, 8) and the kept 3.
  assert ckpt.all_steps() == [3, 6, 8]
  state, meta, step = ckpt.restore(abstract_like(tree(0)), step=3)
  assert step == 3 and meta["step"] == 3
  np.testing.assert_array_equal(state["w"], np.full((3,), 3.0))


def test_fraction_knob_is_checked_and_cosmetic():
  cfg = tiny.loop_config("bf16")
  fp = run_config.fingerprint(cfg)
  cfg.checkpoint_keep_fractions = (0.25, 0.5)
  cfg.diagnostics.code_churn = True
  assert run_config.fingerprint(cfg) == fp
  assert build(cfg).loop.keep_steps == (10, 20)  # of rl.steps = 40
  cfg.checkpoint_keep_fractions = (0.5, 1.5)
  with pytest.raises(ValueError, match=r"--config.checkpoint_keep_fractions=.*\(0, 1\]"):
    build(cfg)
