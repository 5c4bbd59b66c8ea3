"""experiments/bench_gemm runs end to end at tiny sizes (CPU) and reports ratios per round."""
import json
import math

import pytest

from experiments import bench_gemm


def test_small_run_reports_every_comparison(tmp_path):
  out = tmp_path / "bench.json"
  # What `--small --sizes=32x32x48 --repeats=2 --iters=1 --out=...` runs.
  text, results = bench_gemm.run(small=True, sizes=["32x32x48"], repeats=2, iters=1,
                                 model="qwen3_0_6b", batch=8, seq_len=1024, recipe="mxfp8",
                                 step_format="fp8_e4m3", train_step=True)
  bench_gemm.write_json(results, str(out))
  assert "backend cpu" in text and "ratio = baseline time / candidate time" in text
  rows = json.loads(out.read_text())
  assert [r["name"] for r in rows] == ["fp8_e4m3 32x32x48", "mxfp8_e4m3 32x32x48",
                                       "train step gemm=native (fp8_e4m3)"]
  assert [r["baseline"] for r in rows] == ["bf16", "bf16", "emulated"]
  for r in rows:
    assert len(r["ratios"]) == 2 and all(x > 0 and math.isfinite(x) for x in r["ratios"])
    assert r["ratio"] == pytest.approx(sorted(r["ratios"])[0] / 2 + sorted(r["ratios"])[1] / 2)
    assert r["name"] in text
  assert rows[0]["flops"] == 2 * 32 * 32 * 48 and rows[2]["flops"] == 0


def test_bad_size_names_the_flag():
  with pytest.raises(ValueError, match="--sizes entry '64x64': use MxKxN"):
    bench_gemm.parse_size("64x64")
  with pytest.raises(ValueError, match="--repeats=0"):
    bench_gemm.run(small=True, sizes=None, repeats=0, iters=1, model="tiny", batch=1, seq_len=4,
                   recipe="mxfp8", step_format="fp8_e4m3", train_step=False)
