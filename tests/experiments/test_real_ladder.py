"""experiments.real_ladder's summaries (the batch-clustered interval, the chunks of the backward
design) and experiments.phase_times' per-phase summary, on numbers built by hand."""
import numpy as np
import pytest

from experiments import paired, phase_times, real_ladder
from lowrl.analysis import stats


def test_step_summary_batch_interval_is_the_t_interval_of_batch_means():
  rng = np.random.default_rng(0)
  batches, per = 4, 3
  base = rng.normal(0.5, 0.1, batches * per)
  # Each rung lowers every prompt of batch b by 0.01 * (b + 1), plus per-prompt noise.
  shift = np.repeat(0.01 * (np.arange(batches) + 1), per)
  kl = {}
  for i, name in enumerate(paired.LADDER):
    kl[name] = (base - i * shift + rng.normal(0, 0.001, base.size)).tolist()
  out = real_ladder.step_summary(kl, batches)
  assert list(out) == [f"{a} -> {b}" for a, b in zip(paired.LADDER[:-1], paired.LADDER[1:])]
  for name, s in out.items():
    a, b = name.split(" -> ")
    d = np.asarray(kl[b]) - np.asarray(kl[a])
    means = np.array([d[k * per:(k + 1) * per].mean() for k in range(batches)])
    n, m, sd = batches, means.mean(), means.std(ddof=1)
    half = stats.t_quantile_two_sided(0.05, n - 1) * sd / np.sqrt(n)
    assert s["batch_ci_low"] == pytest.approx(m - half, rel=1e-9)
    assert s["batch_ci_high"] == pytest.approx(m + half, rel=1e-9)
    assert s["mean"] == pytest.approx(d.mean(), rel=1e-12)
    assert s["lower"] == int((d < 0).sum()) == batches * per  # every prompt went down
    assert s["prompts"] == batches * per and s["batches"] == batches


def test_step_summary_refuses_prompts_not_divisible_into_batches():
  kl = {name: [0.1] * 5 for name in paired.LADDER}
  with pytest.raises(ValueError):
    real_ladder.step_summary(kl, 2)


def test_merge_backward_concatenates_chunks_in_batch_order():
  def part(offset, n):
    rows = {"cos_fp32": [offset + i for i in range(n)], "heldout_delta": [-offset - i
                                                                           for i in range(n)]}
    return {"units": "batches", "heldout_base": 1.5, "modes": {"dequantized": rows,
                                                               "fp32": {"heldout_delta": [offset]}},
            "churn_by_forward": {"+4/6": {"codes": [offset] * n, "scales": [2 * offset] * n}}}
  out = real_ladder.merge_backward([part(0, 2), part(10, 3)])
  assert out["modes"]["dequantized"]["cos_fp32"] == [0, 1, 10, 11, 12]
  assert out["modes"]["dequantized"]["heldout_delta"] == [0, -1, -10, -11, -12]
  assert out["modes"]["fp32"]["heldout_delta"] == [0, 10]
  assert out["churn_by_forward"]["+4/6"]["scales"] == [0, 0, 20, 20, 20]
  assert out["heldout_base"] == 1.5


def test_phase_summary_leaves_out_each_phase_first_call():
  calls = [("rollout", 30.0), ("score", 5.0), ("update", 40.0), ("rollout", 3.0),
           ("score", 1.0), ("update", 2.0), ("rollout", 5.0), ("update", 4.0)]
  out = phase_times._summary(calls)  # noqa: SLF001
  assert list(out) == ["rollout", "score", "update"]
  assert out["rollout"] == {"calls": 3, "first_s": 30.0, "median_after_first_s": 4.0,
                            "min_s": 3.0, "max_s": 5.0}
  assert out["score"]["median_after_first_s"] == 1.0 and out["score"]["calls"] == 2
  assert out["update"]["max_s"] == 4.0


def test_heap_trim_loop_calls_trim_until_stopped():
  import threading
  stop, calls = threading.Event(), []

  def trim():
    calls.append(1)
    if len(calls) == 3:
      stop.set()
  real_ladder.trim_heap_loop(stop, 0.0, trim)
  assert len(calls) == 3


def test_heap_trimmer_is_off_at_zero_seconds_and_stops_when_told():
  import ctypes
  import ctypes.util
  import threading
  assert real_ladder.start_heap_trimmer(0.0) is None
  name = ctypes.util.find_library("c")
  glibc = bool(name) and hasattr(ctypes.CDLL(name), "malloc_trim")
  stop = real_ladder.start_heap_trimmer(3600.0)
  assert (stop is not None) == glibc
  if stop is not None:
    thread = next(t for t in threading.enumerate() if t.name == "malloc_trim")
    assert thread.daemon and thread.is_alive()
    stop.set()
    thread.join(30)
    assert not thread.is_alive()


def _backward_part(offset, n, base=1.5):
  rows = {"cos_fp32": [offset + i for i in range(n)], "heldout_delta": [-offset - i
                                                                         for i in range(n)]}
  return {"units": "batches", "heldout_base": base, "modes": {"dequantized": rows}}


def test_resumed_backward_keeps_whole_chunks_and_refuses_a_partial_one(tmp_path):
  import json
  out = tmp_path / "bw.json"
  assert real_ladder.resumed_backward(str(out), 20, 5) is None  # nothing to resume
  out.write_text(json.dumps({"seconds": {}}))
  assert real_ladder.resumed_backward(str(out), 20, 5) is None  # a run stopped before any chunk
  out.write_text(json.dumps({"backward": real_ladder.merge_backward([_backward_part(0, 5),
                                                                     _backward_part(5, 5)])}))
  done = real_ladder.resumed_backward(str(out), 20, 5)
  assert real_ladder.done_batches(done) == 10
  assert done["modes"]["dequantized"]["cos_fp32"] == list(range(10))
  with pytest.raises(ValueError, match="whole chunks"):
    real_ladder.resumed_backward(str(out), 20, 4)
  with pytest.raises(ValueError, match="whole chunks"):
    real_ladder.resumed_backward(str(out), 8, 5)


def test_merge_backward_refuses_chunks_with_different_heldout_bases():
  with pytest.raises(ValueError, match="held-out base"):
    real_ladder.merge_backward([_backward_part(0, 2), _backward_part(2, 2, base=1.25)])
