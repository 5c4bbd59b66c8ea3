"""Imported by every Python process the tests launch with `fusion_emitters.child_env` (it puts
this folder first on PYTHONPATH): such a process compiles as the test workers do."""
import os
import sys

if os.environ.get("LOWRL_TEST_ELEMENTAL_EMITTER") == "1":
  sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  import fusion_emitters

  fusion_emitters.install()
  del sys.path[0]
