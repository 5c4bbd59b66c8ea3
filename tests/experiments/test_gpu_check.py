"""experiments/gpu_check runs every part at the tiny size on CPU, each in its own process, and
records a part past its budget instead of failing."""
import json
import math
import os
import subprocess
import sys

import pytest

from experiments import gpu_check
from experiments.gpu_check_parts import SHAPES
from multiprocess import REPO, child_env

# The parts' processes: one CPU device, the tests' compile flags (and their compilation cache,
# through the inherited JAX_* variables).
ENV = child_env(1)


def _finite_positive(x):
  return isinstance(x, float) and x > 0 and math.isfinite(x)


def _forward_flops(cfg, t):
  """2 N_mm T + 4 L (H hd) T^2 (PaLM's model FLOPs), N_mm from the ModelConfig's widths."""
  q, kv = cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim
  n_mm = (cfg.n_layers * (cfg.d_model * (q + 2 * kv) + q * cfg.d_model + 3 * cfg.d_model * cfg.d_ff)
          + cfg.d_model * cfg.vocab_size)
  return 2 * n_mm * t + 4 * cfg.n_layers * q * t * t


def test_tiny_run_measures_every_part(tmp_path):
  # What `--sizes=tiny --repeats=2 --iters=1 --out_dir=...` runs.
  report = gpu_check.run(sizes=["tiny"], parts=["init", "train", "rollout", "memory"],
                         budgets=gpu_check.parse_budgets(gpu_check.DEFAULT_BUDGETS),
                         total_budget_s=gpu_check.MAX_TOTAL_S, repeats=2, iters=1, env=ENV)
  json_path, md_path = gpu_check.write(report, str(tmp_path))
  parts = json.loads(open(json_path).read())["sizes"]["tiny"]["parts"]
  for name, r in parts.items():
    assert r["status"] == "ok", (name, r.get("output_tail"))
    assert r["device"] == {"platform": "cpu", "device_kind": "cpu", "hardware": None}
  assert parts["init"]["num_params"] == SHAPES["tiny"].model_cfg().num_params()
  assert _finite_positive(parts["init"]["first_call_s"])

  train = parts["train"]
  shape = SHAPES["tiny"]
  # One GRPO step = forward + backward = 3 forwards of every sequence.
  assert train["flops_per_step"] == 3 * shape.train_batch * _forward_flops(shape.model_cfg(),
                                                                           shape.seq_len)
  assert set(train["candidates"]) == {"nvfp4_recipe", "fp8_native"}
  for c in list(train["candidates"].values()) + list(parts["rollout"]["candidates"].values()):
    assert len(c["ratios"]) == 2 and all(_finite_positive(x) for x in c["ratios"])
    assert min(c["ratios"]) == c["ratio_min"] <= c["ratio"] <= c["ratio_max"]
  for c in train["candidates"].values():
    assert c["mfu"] is None and c["baseline_mfu"] is None  # no accelerator peak on CPU
  fp8 = train["candidates"]["fp8_native"]
  assert fp8["fp8_gemm_found"] == "n/a" and fp8["fp8_gemm_calls"] == 0
  roll = parts["rollout"]["candidates"]["nvfp4_recipe"]
  assert parts["rollout"]["new_tokens_per_call"] == shape.rollout_batch * shape.rollout_new_tokens
  assert roll["tokens_per_s"] == pytest.approx(
      shape.rollout_batch * shape.rollout_new_tokens / roll["candidate_s"])

  mem = parts["memory"]
  assert mem["peak_bytes"] is None and mem["peak_over_estimate"] is None  # CPU: no memory_stats
  assert mem["estimate_bytes"] == sum(mem["estimate_terms"].values()) > 0
  assert mem["xla_memory_analysis_bytes"] > 0

  table = open(md_path).read()
  assert "### tiny on cpu (cpu)" in table
  for row in ("| init | init_params", "| train | nvfp4_recipe |", "| train | fp8_native |",
              "| train | fp8_native HLO: cuBLASLt FP8 GEMM calls | 0 (found: n/a",
              "| rollout | nvfp4_recipe |", "| memory | bf16 step, donated | estimate"):
    assert row in table, row


def test_a_part_past_its_budget_is_recorded_and_the_rest_skipped():
  budgets = gpu_check.parse_budgets(gpu_check.DEFAULT_BUDGETS)
  report = gpu_check.run(sizes=["tiny"], parts=["init", "memory"], budgets=budgets,
                         total_budget_s=0.5, repeats=1, iters=1, env=ENV)
  parts = report["sizes"]["tiny"]["parts"]
  assert parts["init"]["status"] == "timeout" and parts["init"]["budget_s"] == pytest.approx(
      0.5, abs=0.1)
  assert parts["memory"] == {"status": "skipped", "reason": "total budget spent"}
  table = gpu_check.markdown(report)
  assert "| init | | **timeout** (budget 0 s) |" in table
  assert "| memory | | **skipped**" in table


def test_a_timed_out_part_keeps_its_finished_rows():
  done = {"baseline_s": 0.02, "candidate_s": 0.01, "ratio": 2.0, "ratio_min": 1.5,
          "ratio_max": 2.5, "ratios": [1.5, 2.5], "compile_s": 3.0, "mfu": 0.25,
          "baseline_mfu": 0.125}
  report = {"versions": {"jax": "0"}, "repeats": 2, "iters": 1, "wall_s": 9.0,
            "total_budget_s": 10.0, "sizes": {"qwen3_0_6b": {"parts": {"train": {
                "status": "timeout", "budget_s": 9.0, "partial": {
                    "device": {"platform": "gpu", "device_kind": "NVIDIA H200"},
                    "candidates": {"nvfp4_recipe": done}}}}}}}
  table = gpu_check.markdown(report)
  assert "### qwen3_0_6b on NVIDIA H200 (gpu)" in table
  assert "| train | | **timeout** (budget 9 s; finished rows below) |" in table
  assert ("| train | nvfp4_recipe | 10 ms/step | 20 ms | 2.00 [1.50, 2.50] | 25.0% / 12.5% | 3.0 |"
          in table)


def test_bad_flags_are_one_line_errors():
  with pytest.raises(ValueError, match="--budgets entry 'train:0': use part:seconds"):
    gpu_check.parse_budgets("init:1,train:0,rollout:1,memory:1")
  with pytest.raises(ValueError, match="unknown part"):
    gpu_check.parse_budgets("init:1,train:1,rollout:1,memory:1,warp:1")
  with pytest.raises(ValueError, match=r"has no budget for \['memory'\]"):
    gpu_check.parse_budgets("init:1,train:1,rollout:1")
  with pytest.raises(ValueError, match="--sizes entry 'qwen3_70b'"):
    gpu_check.check_flags(["qwen3_70b"], ["init"], 10, 1, 1)
  with pytest.raises(ValueError, match="--repeats=0"):
    gpu_check.check_flags(["tiny"], ["init"], 10, 0, 1)
  # The binary: the line alone on stderr, status 2 (it was a traceback).
  out = subprocess.run([sys.executable, "-m", "experiments.gpu_check", "--repeats=0",
                        "--dry_run"], cwd=REPO, env=ENV, capture_output=True, text=True,
                       timeout=300)
  assert out.returncode == 2 and out.stderr == "error: --repeats=0 and --iters=2 must be >= 1.\n"
