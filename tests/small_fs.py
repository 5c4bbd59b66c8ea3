"""Small or read-only filesystems for the disk-fault tests: a tmpfs mounted for the test (needs
root, i.e. CAP_SYS_ADMIN; the test is skipped where mounting is not allowed)."""
from __future__ import annotations

import contextlib
import os
import subprocess
from collections.abc import Iterator

import pytest


@contextlib.contextmanager
def tmpfs(path: str, size: str) -> Iterator[str]:
  """Mounts a tmpfs of `size` (mount's syntax: "2m") at `path` for the block, then unmounts it."""
  os.makedirs(path, exist_ok=True)
  r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", path],
                     capture_output=True, text=True)
  if r.returncode:
    pytest.skip(f"cannot mount a tmpfs here ({r.stderr.strip()[:100]}): needs root")
  try:
    yield path
  finally:
    subprocess.run(["umount", "-l", path], check=False)


def remount_read_only(path: str) -> None:
  """Makes the tmpfs at `path` read-only (root bypasses file permissions; a mount does not)."""
  subprocess.run(["mount", "-o", "remount,ro", path], check=True)
