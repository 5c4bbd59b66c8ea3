"""The suite's longest-first order: per-file seconds parsed from pytest's --durations report, the
stored table naming only files that exist, and the collection sorted by it."""
import file_durations

REPORT = """\
============================= slowest durations ==============================
120.50s call     tests/experiments/test_paired.py::test_ladder_scores_every_rung
30.25s setup    tests/experiments/test_paired.py::test_ladder_scores_every_rung
1.00s teardown tests/experiments/test_paired.py::test_ladder_scores_every_rung
12.00s call     tests/sampling/test_refit.py::test_mismatches_compare_bits[a::b]
(2 durations < 0.005s hidden.  Use -vv to show these durations.)
0.50s call     tests/sampling/test_refit.py::test_refitter_syncs_on_a_new_version
0.00s call     tests/test_quick.py::test_quick
=========================== 3 passed in 165.25s ===========================
"""


def test_parse_sums_setup_call_and_teardown_per_file_longest_first():
  seconds = file_durations.parse(REPORT)
  assert seconds == {"tests/experiments/test_paired.py": 151.75,
                     "tests/sampling/test_refit.py": 12.5,
                     "tests/test_quick.py": 0.01}  # ran, in less than pytest's 0.01 s
  assert list(seconds) == ["tests/experiments/test_paired.py", "tests/sampling/test_refit.py",
                           "tests/test_quick.py"]


def test_the_table_names_existing_test_files():
  table = file_durations.load()
  assert table and all(s > 0 for s in table.values())
  stale = set(table) - set(file_durations.suite_files())
  assert not stale, f"{sorted(stale)} no longer exist: regenerate (tests/file_durations.py)"


def test_collection_runs_the_longest_files_first(request):
  table = file_durations.load()
  files = list(dict.fromkeys(i.nodeid.split("::", 1)[0] for i in request.session.items))
  timed = [table[f] for f in files if f in table]
  assert timed == sorted(timed, reverse=True)
  # Files without a duration come after every file with one.
  known = [f in table for f in files]
  assert known == sorted(known, reverse=True)
