"""The training binary under LoRA, SIGKILLed after its step-2 checkpoint and resumed (one process
per run, test_resume_kill's harness): the uninterrupted run's metrics and adapters bit for bit.
Apart from tests/training/test_lora_loop.py (in-process LoRA runs) so that neither file holds a
worker for more than ~2 minutes."""
import json
import os
import signal

import jax
import numpy as np
import pytest

from lowrl.models import lora
from lowrl.training.state import final_params
from test_resume_kill import _at_checkpoint_2, _finish, _metrics, _train


@pytest.mark.slow
@pytest.mark.parametrize("packed", [False, True], ids=["fp32_base", "packed_nvfp4_base"])
def test_lora_run_killed_by_sigkill_resumes_bit_identically(tmp_path, packed):
  """The training binary under LoRA, SIGKILLed after its step-2 checkpoint, resumed: the
  uninterrupted run's metrics (but the resumed sampler's first sync, which moves the base
  again) and final adapters bit for bit. With the FP32 recipe's base, and with the NVFP4 base
  held packed (configs/lora_nvfp4.py, lora.packed_base: the resumed process packs the stored
  base again)."""
  # test_resume_kill's run (its tiny model on 1-digit addition after 50 SFT steps: rewards above
  # 0, so the adapters train) under the recipe's config file.
  flags = (f"--config=configs/{'lora_nvfp4' if packed else 'fp32'}.py", "--config.lora.rank=4",
           "--config.lora.alpha=8")
  full, killed = str(tmp_path / "full"), str(tmp_path / "killed")
  _finish(_train(full, *flags))
  assert any(r["reward/mean"] > 0 for r in _metrics(full))
  proc = _at_checkpoint_2(killed, *flags)
  proc.send_signal(signal.SIGKILL)
  proc.communicate()
  assert proc.returncode == -signal.SIGKILL, "the run finished before it could be killed"
  assert "[resume] from step" in _finish(_train(killed, *flags))
  drop = lambda rows: [{k: v for k, v in r.items() if k != "refit/sync_bytes"}  # noqa: E731
                       for r in rows]
  assert drop(_metrics(killed)) == drop(_metrics(full))
  with open(os.path.join(full, "summary.json")) as f, open(os.path.join(killed,
                                                                         "summary.json")) as g:
    assert json.load(f)["eval_end"] == json.load(g)["eval_end"]
  from experiments.export_hf import run_config_of

  def adapters(workdir: str):
    cfg = run_config_of(workdir)
    # The runs had one device; this worker's 8 would split the 32-wide NVFP4 blocks (the
    # adapters are replicated and the base is packed whole, so the values are the same).
    cfg.mesh.rules = ()
    return lora.split(final_params(cfg, workdir))[1]

  want, got = adapters(full), adapters(killed)
  for x, y in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    np.testing.assert_array_equal(np.asarray(x).view(np.uint8), np.asarray(y).view(np.uint8))
  b = [x for kp, x in jax.tree_util.tree_leaves_with_path(want) if kp[-1].key == lora.B]
  assert b and all(np.abs(np.asarray(x)).max() > 0 for x in b)  # the adapters trained
