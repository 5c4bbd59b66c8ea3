"""Seconds per test file, the suite's longest-first order (tests/data/durations.json).

pytest-xdist hands whole files to workers in collection order (`--dist loadfile
--no-loadscope-reorder` in pyproject.toml); conftest.py sorts the files longest first by this
table, so a 3-minute file is never handed out last to run alone at the end. Regenerate it from a
full run's `--durations=0` report (setup + call + teardown of every test, summed per file):

  python -m pytest --durations=0 --durations-min=0 | tee /tmp/pytest_durations.txt
  python tests/file_durations.py /tmp/pytest_durations.txt   # rewrites tests/data/durations.json
  python tests/file_durations.py --check                      # test files the table lacks

Only the order matters: times taken at any load are comparable to each other within one run.
"""
from __future__ import annotations

import json
import pathlib
import re
import sys

TESTS = pathlib.Path(__file__).resolve().parent
TABLE = TESTS / "data" / "durations.json"
# "12.34s call     tests/x/test_y.py::test_z[param]" (pytest's --durations report line).
_LINE = re.compile(r"^\s*(\d+(?:\.\d+)?)s\s+(?:setup|call|teardown)\s+([^\s:]+\.py)::")


def parse(report: str) -> dict[str, float]:
  """{test file: seconds} summed over a `--durations=0` report's lines, longest first."""
  seconds: dict[str, float] = {}
  for line in report.splitlines():
    m = _LINE.match(line)
    if m:
      seconds[m.group(2)] = seconds.get(m.group(2), 0.0) + float(m.group(1))
  # pytest prints each duration to 0.01 s, so a file of quick tests can sum to 0.00: it still ran,
  # and 0.01 keeps it in the table (which holds only positive times) behind every slower file.
  return dict(sorted(((f, max(round(s, 2), 0.01)) for f, s in seconds.items()),
                     key=lambda kv: -kv[1]))


def load() -> dict[str, float]:
  """The stored table ({} when there is none)."""
  if not TABLE.exists():
    return {}
  return json.loads(TABLE.read_text())["seconds"]


def suite_files() -> list[str]:
  """Every test file of the suite, as pytest names it (relative to the repository)."""
  root = TESTS.parent
  return sorted(str(p.relative_to(root)) for p in TESTS.rglob("test_*.py"))


def main(argv: list[str]) -> int:
  if argv == ["--check"]:
    missing = [f for f in suite_files() if f not in load()]
    print("\n".join(missing) if missing else "every test file has a duration")
    return 1 if missing else 0
  if len(argv) != 1:
    print(__doc__)
    return 2
  seconds = parse(pathlib.Path(argv[0]).read_text())
  if not seconds:
    raise SystemExit(f"{argv[0]}: no --durations lines (run pytest with --durations=0)")
  TABLE.write_text(json.dumps({"source": f"pytest --durations=0 report ({argv[0]})",
                               "seconds": seconds}, indent=1) + "\n")
  print(f"{len(seconds)} files -> {TABLE}")
  return 0


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
