"""A test run where a worker dies of a native crash fails and names the tests that never ran
(tests/run_count.py), instead of a summary that looks nearly green."""
import os
import subprocess
import sys

TESTS = os.path.dirname(os.path.abspath(__file__))


def test_a_crashed_worker_fails_the_run_and_lists_the_tests_that_did_not_run(tmp_path):
  (tmp_path / "pytest.ini").write_text("[pytest]\n")
  # Two files, one per worker; the first test of `test_a` aborts its worker like a native crash.
  (tmp_path / "test_a.py").write_text(
      "import os\n\ndef test_crash():\n  os.abort()\n\n"
      + "".join(f"def test_a{i}():\n  pass\n\n" for i in range(3)))
  (tmp_path / "test_b.py").write_text("def test_b():\n  pass\n")
  env = dict(os.environ, PYTHONPATH=TESTS, PYTHONFAULTHANDLER="")
  out = subprocess.run(
      [sys.executable, "-m", "pytest", "-q", "-p", "run_count", "-p", "no:cacheprovider",
       "-n", "2", "--dist", "loadfile", "--max-worker-restart=0"],
      cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
  text = out.stdout + out.stderr
  assert out.returncode != 0, text
  assert "NOT RUN: 3 of 5 collected tests never ran" in text, text
  not_run = next(line for line in text.splitlines() if line.startswith("NOT RUN"))
  assert all(f"test_a.py::test_a{i}" in not_run for i in range(3))
  assert "test_b" not in not_run and "test_crash" not in not_run  # these ran (one crashed)

