"""Run integrity end to end in `loop.run` on a tiny config: a crash with a damaged newest checkpoint
then a resume (fallback, one TensorBoard point per step), a finished run re-run, a changed config,
repeated skipped updates, an earlier attempt's logs with only unfinished checkpoints, damaged or
missing bookkeeping files, a read-only workdir holding a finished run."""
import json
import os
import re
import shutil

import ml_collections
import pytest
import small_fs
import tiny
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from tensorboard.plugins.custom_scalar import layout_pb2

from lowrl.metrics import layout
from lowrl.training import loop, pace, run_config, run_logs
from lowrl.training.checkpointing import Checkpointer, verify_manifest

STEPS = 4


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory):
  return str(tmp_path_factory.mktemp("base"))


def tiny_config(base_dir: str) -> ml_collections.ConfigDict:
  c = tiny.loop_config("fp32", base_dir, steps=STEPS)
  c.eval_every = 2  # an evaluation between the start and the end, redone by the resume
  return c


class _Crash(Exception):
  pass


def _crash_at(prefix: str, logs: list[str]):
  def log(msg: str) -> None:
    logs.append(msg)
    if msg.startswith(prefix):
      raise _Crash
  return log


def _scalar_steps(workdir: str, key: str, run: str = layout.RL_RUN) -> list[int]:
  """Steps of metric `key`'s points (under its TensorBoard tag) in the run <workdir>/tb/<run>."""
  acc = EventAccumulator(os.path.join(workdir, "tb", run), size_guidance={"scalars": 0})
  acc.Reload()
  return [e.step for e in acc.Scalars(layout.tag(key))]


def _metric_steps(workdir: str) -> list[int]:
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    return [json.loads(line)["step"] for line in f]


@pytest.fixture(scope="module")
def resumed_run(base_dir, tmp_path_factory):
  """Crashes after step 3 is logged (checkpoints 1, 2 saved), damages checkpoint 2, resumes."""
  workdir = str(tmp_path_factory.mktemp("resumed"))
  cfg = tiny_config(base_dir)
  first: list[str] = []
  with pytest.raises(_Crash):
    loop.run(cfg, workdir, log=_crash_at(f"[rl] step 3/{STEPS}", first))
  ckpt = Checkpointer(os.path.join(workdir, "checkpoints"), every=1)
  assert ckpt.all_steps() == [1, 2]
  assert _scalar_steps(workdir, "reward/mean") == [1, 2, 3]  # flushed despite the crash
  data = os.path.join(ckpt.step_dir(2), "state", "ocdbt.process_0", "d")
  victim = os.path.join(data, sorted(os.listdir(data))[0])
  raw = bytearray(open(victim, "rb").read())
  raw[len(raw) // 2] ^= 0x01  # one flipped bit, the file size unchanged
  open(victim, "wb").write(bytes(raw))
  second: list[str] = []
  summary = loop.run(cfg, workdir, log=second.append)
  return workdir, first, second, summary


def test_damaged_checkpoint_falls_back_and_tensorboard_has_one_point_per_step(resumed_run,
                                                                             base_dir):
  workdir, _, logs, summary = resumed_run
  assert any("step 2 is damaged" in m and "falling back to step 1" in m for m in logs), logs
  assert any(m.startswith("[resume] from step 1") for m in logs)
  assert os.path.isdir(os.path.join(workdir, "checkpoints.damaged", "2"))  # kept, aside
  ckpt = Checkpointer(os.path.join(workdir, "checkpoints"), every=1)
  assert ckpt.all_steps() == [STEPS - 1, STEPS]
  assert all(verify_manifest(ckpt.step_dir(s)) is None for s in ckpt.all_steps())
  assert _metric_steps(workdir) == list(range(1, STEPS + 1))
  # Points 2 and 3 logged before the crash were replaced by the resumed run's.
  assert _scalar_steps(workdir, "reward/mean") == list(range(1, STEPS + 1))
  # The evaluation at step 2 (logged before the crash) was replaced by the resumed run's.
  assert _scalar_steps(workdir, "eval/pass_at_1") == [0, 2, STEPS]
  # This run trained the base: its loss is the TensorBoard run tb/sft.
  assert _scalar_steps(workdir, "sft/loss", run=layout.SFT_RUN) == [1, 2, 3, 4, 5]
  assert set(summary) >= {"config_fingerprint", "final_train_reward", "eval_end"}
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    last = json.loads(f.readlines()[-1])
  assert summary["final_train_reward"] == last["reward/mean"]
  assert summary["config_fingerprint"] == run_config.fingerprint(tiny_config(base_dir))


def test_tensorboard_opens_on_reward_evaluation_and_pace(resumed_run, base_dir):
  """Named runs, the first groups, one pace point per step after the resume, the layout."""
  workdir = resumed_run[0]
  assert sorted(os.listdir(os.path.join(workdir, "tb"))) == [layout.RL_RUN, layout.SFT_RUN]
  acc = EventAccumulator(os.path.join(workdir, "tb", layout.RL_RUN),
                         size_guidance={"scalars": 0, "tensors": 0})
  acc.Reload()
  tags = acc.Tags()["scalars"]
  assert sorted({t.split("/")[0] for t in tags})[:3] == ["1_reward", "2_eval", "3_run"]
  cfg, rows = tiny_config(base_dir), run_logs.read_metrics(workdir)
  lr = acc.Scalars("3_run/lr")
  assert [e.step for e in lr] == list(range(1, STEPS + 1))
  want = [pace.Pace.from_config(cfg).lr(s) for s in range(STEPS)]
  assert [e.value for e in lr] == pytest.approx(want)
  step_time = acc.Scalars("3_run/step_time_s")
  assert all(e.value > 0 for e in step_time)
  rows_per_step = cfg.rl.num_prompts * cfg.rl.group_size
  for e, tok, row in zip(step_time, acc.Scalars("3_run/tokens_per_s"), rows):
    assert tok.value == pytest.approx(row["response_length"] * rows_per_step / e.value, rel=1e-5)
  assert not any(k.startswith("run/") for k in rows[0])  # wall times stay out of metrics.jsonl
  got = layout_pb2.Layout.FromString(
      acc.Tensors("custom_scalars__config__")[0].tensor_proto.string_val[0])
  for category in got.category:
    for chart in category.chart:
      for pattern in chart.multiline.tag:
        assert any(re.search(pattern, t) for t in tags), (chart.title, pattern)


def test_finished_run_is_not_run_again(resumed_run, base_dir):
  workdir, _, _, summary = resumed_run
  before = open(os.path.join(workdir, "summary.json")).read()
  logs: list[str] = []
  assert loop.run(tiny_config(base_dir), workdir, log=logs.append) == json.loads(before)
  assert any(m.startswith("[done]") for m in logs)
  assert not any(m.startswith("[eval]") for m in logs)
  assert open(os.path.join(workdir, "summary.json")).read() == before
  assert _scalar_steps(workdir, "eval/pass_at_1") == [0, 2, STEPS]


def test_resume_with_changed_config_is_refused(resumed_run, base_dir):
  workdir = resumed_run[0]
  cfg = tiny_config(base_dir)
  old_lr = cfg.optimizer.lr
  assert old_lr != 1e-3
  cfg.optimizer.lr = 1e-3
  with pytest.raises(run_config.ConfigChangedError,
                     match=re.escape(f"optimizer.lr: {old_lr!r} -> 0.001")):
    loop.run(cfg, workdir, log=lambda _: None)


def test_repeated_skipped_updates_stop_with_the_last_good_checkpoint(base_dir, tmp_path,
                                                                     monkeypatch):
  """Updates 3.. report a skip (what the guard does on a non-finite update): the run stops after
  `max_skipped_steps` of them, naming checkpoint 2, which is intact. The workdir starts with an
  earlier attempt's logs and only an unfinished checkpoint: they are moved aside, not rewritten
  (the unfinished save and a half-written temporary file are removed)."""
  workdir = str(tmp_path)
  os.makedirs(os.path.join(workdir, "checkpoints", "3.orbax-checkpoint-tmp-99"))
  with open(os.path.join(workdir, "summary.json.tmp"), "w") as f:  # killed while writing it
    f.write('{"eval_st')
  with open(os.path.join(workdir, "metrics.jsonl"), "w") as f:
    f.write('{"step": 1, "old": 1}\n')
  real_init = loop.Trainer.__init__

  def init(self, *args, **kwargs):
    real_init(self, *args, **kwargs)
    real_step, calls = self.step, [0]

    def step(*a):
      calls[0] += 1
      params, opt_state, m = real_step(*a)
      if calls[0] > 2:
        m = dict(m, skipped_updates=1.0)
      return params, opt_state, m
    self.step = step
  monkeypatch.setattr(loop.Trainer, "__init__", init)

  cfg = tiny_config(base_dir)
  cfg.max_skipped_steps = 2
  logs: list[str] = []
  with pytest.raises(loop.NonFiniteError, match=r"2 consecutive steps \(up to step 4\).*last good "
                                                r"checkpoint is step 3"):
    loop.run(cfg, workdir, log=logs.append)
  # Step 3's skipped update left a finite state (saved); step 4 stopped before its save.
  ckpt = Checkpointer(os.path.join(workdir, "checkpoints"), every=1)
  assert ckpt.all_steps() == [2, 3]
  assert all(verify_manifest(ckpt.step_dir(s)) is None for s in ckpt.all_steps())
  assert _metric_steps(workdir) == [1, 2, 3, 4]
  assert any(m.startswith("[warn]") and "moved to" in m for m in logs)
  with open(os.path.join(workdir, "previous", "0", "metrics.jsonl")) as f:
    assert f.read() == '{"step": 1, "old": 1}\n'
  assert not any("orbax-checkpoint-tmp" in d for d in os.listdir(os.path.join(workdir,
                                                                              "checkpoints")))
  assert not os.path.exists(os.path.join(workdir, "summary.json.tmp"))
  assert "[workdir] removed temporary files of an interrupted write: summary.json.tmp" in logs


def test_reevaluate_on_request_adds_no_point(resumed_run, base_dir):
  workdir, _, _, summary = resumed_run
  logs: list[str] = []
  again = loop.run(tiny_config(base_dir), workdir, log=logs.append, reevaluate=True)
  assert again["eval_end"] == summary["eval_end"]  # same params, same eval key
  assert any(m.startswith("[eval] held-out") for m in logs)
  assert _scalar_steps(workdir, "eval/pass_at_1") == [0, 2, STEPS]
  assert _metric_steps(workdir) == list(range(1, STEPS + 1))


def _damaged_copy(resumed_run, tmp_path, name: str, content: bytes | None) -> str:
  """A copy of the finished run's workdir with `name` replaced by `content` (None: deleted)."""
  workdir = str(tmp_path / "copy")
  shutil.copytree(resumed_run[0], workdir)
  path = os.path.join(workdir, name)
  if content is None:
    os.remove(path)
  else:
    with open(path, "wb") as f:
      f.write(content)
  return workdir


def _snapshot(workdir: str) -> dict[str, bytes]:
  out = {}
  for root, _, files in os.walk(workdir):
    for f in files:
      if f != ".lowrl.lock":
        out[os.path.relpath(os.path.join(root, f), workdir)] = open(os.path.join(root, f),
                                                                    "rb").read()
  return out


@pytest.mark.parametrize("name, content, summary, fix", [
    ("config.json", b'{"fingerprint": "ab', False, "restore it, or move it aside"),
    ("metrics.jsonl", b'{"step": 1, "reward/mean": 0.5}\ngarbage\n', False, "delete that line"),
    ("metrics.jsonl", b'{"step": 1}\n{"step": 2}\n{"step": 1}\n', False,
     "delete the repeated lines"),
    ("eval_start.json", None, False, "restore it, or start afresh"),
    ("summary.json", b"\x00\x01", True, "move it aside and re-run"),
])
def test_damaged_bookkeeping_file_is_one_line_naming_it_and_nothing_is_overwritten(
    resumed_run, base_dir, tmp_path, name, content, summary, fix):
  workdir = _damaged_copy(resumed_run, tmp_path, name, content)
  if not summary:  # the resume path (a finished run's summary would be returned first)
    os.remove(os.path.join(workdir, "summary.json"))
  before = _snapshot(workdir)
  with pytest.raises(run_logs.WorkdirError) as e:
    loop.run(tiny_config(base_dir), workdir, log=lambda _: None)
  msg = str(e.value)
  assert msg.startswith(os.path.join(workdir, name)) and fix in msg and "\n" not in msg, msg
  assert _snapshot(workdir) == before


def test_a_changed_config_is_refused_from_the_checkpoints_fingerprint_without_config_json(
    resumed_run, base_dir, tmp_path):
  workdir = _damaged_copy(resumed_run, tmp_path, "config.json", None)
  os.remove(os.path.join(workdir, "summary.json"))
  cfg = tiny_config(base_dir)
  cfg.optimizer.lr = 1e-3
  with pytest.raises(run_config.ConfigChangedError, match="newest checkpoint was saved under "
                     "config fingerprint .*/config.json is missing"):
    loop.run(cfg, workdir, log=lambda _: None)


def test_a_finished_run_in_a_read_only_workdir_prints_its_summary(resumed_run, base_dir,
                                                                  tmp_path):
  with small_fs.tmpfs(str(tmp_path / "ro"), "8m") as mnt:
    workdir = os.path.join(mnt, "run")
    shutil.copytree(resumed_run[0], workdir)
    small_fs.remount_read_only(mnt)
    logs: list[str] = []
    with open(os.path.join(workdir, "summary.json")) as f:
      expected = json.load(f)
    summary = loop.run(tiny_config(base_dir), workdir, log=logs.append)
  assert summary == expected
  assert any(m.startswith("[done]") for m in logs)


def test_a_finished_run_whose_end_has_no_manifest_is_not_evaluated_again(resumed_run, base_dir,
                                                                          tmp_path):
  workdir = _damaged_copy(resumed_run, tmp_path, f"checkpoints/{STEPS}/lowrl_manifest.json", None)
  with open(os.path.join(workdir, "summary.json")) as f:
    summary = json.load(f)
  logs: list[str] = []
  assert loop.run(tiny_config(base_dir), workdir, log=logs.append) == summary
  assert any(m.startswith("[done]") for m in logs) and not any("[eval]" in m for m in logs)
