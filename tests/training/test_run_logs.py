"""Log files (`lowrl.training.run_logs`): a metrics line is strict JSON, the ETA leaves out the
compiling first step, an earlier attempt's logs are moved aside, not overwritten."""
import json


from lowrl.training import run_logs


def test_metrics_line_is_strict_json():
  line = run_logs.metrics_line(3, {"a": float("nan"), "b": float("inf"), "c": 0.1234567, "d": 2})

  def reject(name):
    raise AssertionError(f"bare {name} in {line}")
  assert json.loads(line, parse_constant=reject) == {"step": 3, "a": None, "b": None,
                                                     "c": 0.123457, "d": 2.0}


def test_eta_leaves_out_the_compiling_first_step():
  now = [0.0]
  eta = run_logs.Eta(total=10, clock=lambda: now[0])
  now[0] = 100.0  # step 1: compile
  assert eta.update(1) == "elapsed 100s eta ?"
  now[0] = 101.0  # steps 2, 3: 1 s each
  assert eta.update(2) == "elapsed 101s eta 8s"  # 8 steps left at 1 s
  now[0] = 102.0
  assert eta.update(3) == "elapsed 102s eta 7s"


def test_logs_of_an_earlier_attempt_are_moved_not_overwritten(tmp_path):
  (tmp_path / "metrics.jsonl").write_text('{"step": 1}\n')
  (tmp_path / "eval_start.json").write_text("{}")
  assert run_logs.has_logs(str(tmp_path))
  dest = run_logs.move_aside(str(tmp_path))
  assert dest == str(tmp_path / "previous" / "0")
  assert (tmp_path / "previous" / "0" / "metrics.jsonl").read_text() == '{"step": 1}\n'
  assert not run_logs.has_logs(str(tmp_path))


def test_one_clock_for_the_run(monkeypatch):
  """Inside a run (run_clock) every Eta's elapsed counts from the run's start: the SFT's, the
  RL loop's (created later) and the final line's add up instead of restarting at 0."""
  now = [100.0]
  monkeypatch.setattr(run_logs.time, "time", lambda: now[0])
  seen = {}

  @run_logs.run_clock
  def a_run():
    now[0] += 5  # setup
    sft = run_logs.Eta(total=2)
    now[0] += 10
    seen["sft"] = sft.update(1)
    rl = run_logs.Eta(total=4)  # created after the SFT, as the loop's
    now[0] += 20
    seen["rl"] = rl.update(1)
    return now[0] - run_logs.run_started()

  assert a_run() == 35.0
  assert seen == {"sft": "elapsed 15s eta ?", "rl": "elapsed 35s eta ?"}
  assert run_logs.run_started() is None  # reset after the run
  assert run_logs.Eta(total=1).update(1) == "elapsed 0s eta ?"  # outside a run: its own start
