"""lowrl.grid: a resumable grid of jobs -> results JSONL (no JAX: the work is a Python function)."""
import json

import pytest

from lowrl import grid


def _jobs(fp="a"):
  return [grid.Job.of({"setting": s, "seed": seed}, f"{fp}-{s}", payload=(s, seed))
          for s in ("x", "y") for seed in (0, 1)]


def _work(calls):
  def work(job):
    calls.append(job.key)
    s, seed = job.payload
    return {"value": seed * 10 + (s == "y")}
  return work


def test_runs_each_job_once_and_resumes(tmp_path):
  path = str(tmp_path / "sub" / "results.jsonl")
  calls = []
  rows = grid.run(_jobs(), path, _work(calls), log=lambda _: None)
  assert [(r["setting"], r["seed"], r["value"]) for r in rows] == [
      ("x", 0, 0), ("x", 1, 10), ("y", 0, 1), ("y", 1, 11)]
  assert rows[0] == {"setting": "x", "seed": 0, "fingerprint": "a-x", "value": 0}
  assert len(calls) == 4
  logs = []
  assert grid.run(_jobs(), path, _work(calls), log=logs.append) == rows
  assert len(calls) == 4 and "4 already done, 0 to run" in logs[0]
  # A grid grown by one job runs only that one; the old lines are kept.
  more = _jobs() + [grid.Job.of({"setting": "z", "seed": 0}, "a-z", ("z", 0))]
  assert len(grid.run(more, path, _work(calls), log=lambda _: None)) == 5 and len(calls) == 5


def test_interrupted_line_is_dropped_and_rerun(tmp_path):
  path = tmp_path / "results.jsonl"
  calls = []
  grid.run(_jobs()[:2], str(path), _work(calls), log=lambda _: None)
  with open(path, "a") as f:
    f.write('{"setting": "y", "seed": 0, "fingerp')  # a kill in the middle of a write
  rows = grid.run(_jobs(), str(path), _work(calls), log=lambda _: None)
  assert len(calls) == 4 and len(rows) == 4
  lines = path.read_text().splitlines()
  assert len(lines) == 4 and all(json.loads(x) for x in lines)


def test_changed_config_and_bad_grids_are_errors(tmp_path):
  path = str(tmp_path / "r.jsonl")
  grid.run(_jobs(), path, _work([]), log=lambda _: None)
  calls = []
  with pytest.raises(ValueError, match=r"holds setting=x seed=0 from another config \(fingerprint "
                                       r"a-x != b-x\)"):
    grid.run(_jobs("b"), path, _work(calls), log=lambda _: None)
  assert not calls  # checked before anything runs
  with pytest.raises(ValueError, match="two jobs of the grid are named setting=x seed=0"):
    grid.run(_jobs() + _jobs()[:1], str(tmp_path / "other.jsonl"), _work([]))
  with pytest.raises(ValueError, match="empty"):
    grid.run([], path, _work([]))
  with pytest.raises(ValueError, match="may not set"):
    grid.run([grid.Job.of({"name": "n"}, "f")], str(tmp_path / "c.jsonl"),
             lambda j: {"fingerprint": 1}, log=lambda _: None)
  with open(tmp_path / "bad.jsonl", "w") as f:
    f.write("not json\n")
  with pytest.raises(ValueError, match="line 1 is not JSON"):
    grid.read_results(str(tmp_path / "bad.jsonl"))


def test_finished_reads_the_done_jobs_without_running(tmp_path):
  path = tmp_path / "results.jsonl"
  rows = grid.run(_jobs()[:3], str(path), _work([]), log=lambda _: None)
  with open(path, "a") as f:
    f.write('{"setting": "y", "seed": 1, "fingerp')  # a job being written
  # Only the grid's jobs with a complete line, by key; the fourth job is not done yet.
  done = grid.finished(_jobs()[1:], str(path))
  assert list(done.values()) == rows[1:]
  assert list(done) == [j.key for j in _jobs()[1:3]]
  assert path.read_text().endswith('"fingerp')  # read only: the running writer's file is left be
  with pytest.raises(ValueError, match=r"from another config .*; pass the old config"):
    grid.finished(_jobs("b"), str(path), fix="pass the old config")
