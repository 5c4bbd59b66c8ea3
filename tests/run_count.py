"""pytest plugin: a run in which some collected tests never ran (a test worker that died of a
native crash, e.g. `Fatal Python error: Aborted`) fails, listing them.

pytest-xdist reports a crashed worker's current test as failed and, with --max-worker-restart=0
(pyproject.toml), hands out nothing more: the tests queued for that worker never run, and the
summary line ("1 failed, 156 passed") counts only those that did. This plugin counts, on the
controller, the tests the workers collected and those that reported a result; at the end it
prints how many (and which) never ran and makes the exit status non-zero (1, tests failed).
Without xdist it compares the session's own items. Registered by conftest.py (`register`), or
loaded with `-p run_count`.
"""
from __future__ import annotations

import pytest

_SHOWN = 10


class _Counter:
  def __init__(self):
    self.collected: set[str] = set()
    self.reported: set[str] = set()

  @pytest.hookimpl(optionalhook=True)
  def pytest_xdist_node_collection_finished(self, node, ids):
    del node
    self.collected.update(ids)

  def pytest_collection_finish(self, session):
    if not hasattr(session.config, "workerinput"):  # the workers report theirs to the controller
      self.collected.update(item.nodeid for item in session.items)

  def pytest_runtest_logreport(self, report):
    self.reported.add(report.nodeid)

  @pytest.hookimpl(trylast=True)
  def pytest_sessionfinish(self, session, exitstatus):
    if hasattr(session.config, "workerinput") or session.shouldstop or session.shouldfail:
      return  # a worker, or a run stopped on purpose (-x, --maxfail, Ctrl-C)
    missing = sorted(self.collected - self.reported)
    if not missing:
      return
    self.missing = missing
    if exitstatus in (pytest.ExitCode.OK, pytest.ExitCode.NO_TESTS_COLLECTED):
      session.exitstatus = pytest.ExitCode.TESTS_FAILED

  def pytest_terminal_summary(self, terminalreporter):
    missing = getattr(self, "missing", None)
    if not missing:
      return
    shown = ", ".join(missing[:_SHOWN]) + (f" (+{len(missing) - _SHOWN} more)"
                                           if len(missing) > _SHOWN else "")
    terminalreporter.write_line(
        f"NOT RUN: {len(missing)} of {len(self.collected)} collected tests never ran (a test "
        f"worker died?): {shown}", red=True, bold=True)


def register(config) -> None:
  """Adds the counter to a pytest run (once)."""
  if not config.pluginmanager.has_plugin("lowrl_run_count"):
    config.pluginmanager.register(_Counter(), "lowrl_run_count")


def pytest_configure(config):
  register(config)
