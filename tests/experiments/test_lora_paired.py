"""experiments/lora_paired.py: its arms are the configs they name, and its report pairs by seed."""
import pytest

from configs import default, lora_nvfp4
from experiments import lora_paired
from lowrl.training import run_config
from lowrl.training.setup import build


def _shared(c, seed=3, workdir="/w"):
  c.seed, c.sft.seed, c.sft.base_dir = seed, 0, workdir + "/bases"
  return run_config.to_json(c)


def test_arms_are_the_main_job_and_the_lora_recipe():
  base = default.get_config()
  arm = lambda name: run_config.to_json(  # noqa: E731
      lora_paired.arm_config(base, name, 3, "/w", aqn_sigma_start=1e-2))
  assert arm("full") == _shared(default.get_config())
  assert arm("lora_nvfp4") == _shared(lora_nvfp4.get_config())
  aqn = lora_nvfp4.get_config()
  aqn.lora.aqn_sigma_start = 1e-2
  assert arm("lora_nvfp4_aqn") == _shared(aqn)
  bf16 = lora_paired.arm_config(base, "lora_bf16", 3, "/w", aqn_sigma_start=1e-2)
  assert bf16.precision.name == "bf16" and not bf16.lora.packed_base
  assert bf16.lora.rank == 16 and bf16.optimizer.lr == 2e-3
  for name in lora_paired.ARMS:  # every arm is a valid run config
    build(lora_paired.arm_config(base, name, 0, "/w", aqn_sigma_start=1e-2))


def test_report_pairs_by_seed():
  def vals(gains):
    return {s: {m: g for m in lora_paired.MEASURES} for s, g in gains.items()}
  rep = lora_paired.report({"full": vals({0: 0.1, 1: 0.2, 2: 0.3}),
                            "lora_bf16": vals({0: 0.2, 1: 0.2, 2: 0.5, 5: 9.0})})
  r = rep["comparisons"]["lora_bf16 - full"]["heldout_gain"]
  assert r["seeds"] == [0, 1, 2] and r["diffs"] == pytest.approx([0.1, 0.0, 0.2])
  assert r["n"] == 3 and r["mean"] == pytest.approx(0.1) and r["ci_low"] < 0.1 < r["ci_high"]
  assert list(rep["comparisons"]) == ["lora_bf16 - full"]  # arms that did not run: no row
