"""No import in lowrl runs against the layering documented in ARCHITECTURE.md.

The check reads every module's import statements (the AST, so imports inside functions count
too) and compares the layer of the importing module with the layer of each lowrl module it
imports: a module may import its own layer or lower ones, never a higher one.
"""
from __future__ import annotations

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]

# Lowest first; ARCHITECTURE.md "Layering" shows the same order.
LAYERS = (
    ("lowrl.quant", "lowrl.hardware", "lowrl.distributed", "lowrl.metrics"),
    ("lowrl.precision",),
    ("lowrl.models",),
    ("lowrl.sharding", "lowrl.checkpoints", "lowrl.memory", "lowrl.tasks"),
    ("lowrl.sampling",),
    ("lowrl.rl",),
    ("lowrl.training",),
    ("lowrl.asyncrl",),
)
# Data, not code: the named precision recipes are read from configs/<recipe>.py.
ALLOWED_OUTSIDE = {("lowrl.precision", "configs")}


def _layer(module: str) -> int | None:
  for i, packages in enumerate(LAYERS):
    if any(module == p or module.startswith(p + ".") for p in packages):
      return i
  return None


def _module_name(path: pathlib.Path) -> str:
  parts = path.relative_to(ROOT).with_suffix("").parts
  return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: pathlib.Path) -> list[tuple[str, int]]:
  """(imported module, line) of every absolute import in the file."""
  out = []
  for node in ast.walk(ast.parse(path.read_text(), str(path))):
    if isinstance(node, ast.Import):
      out += [(a.name, node.lineno) for a in node.names]
    elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
      # `from lowrl import sharding` imports the module lowrl.sharding.
      out += [(f"{node.module}.{a.name}" if node.module == "lowrl" else node.module,
               node.lineno) for a in node.names]
  return out


MODULES = sorted((ROOT / "lowrl").rglob("*.py"))


def test_every_module_has_a_layer():
  missing = [_module_name(p) for p in MODULES
             if _module_name(p) != "lowrl" and _layer(_module_name(p)) is None]
  assert not missing, f"add these to LAYERS (and ARCHITECTURE.md): {missing}"


@pytest.mark.parametrize("path", MODULES, ids=lambda p: _module_name(p))
def test_imports_follow_the_layering(path):
  name = _module_name(path)
  own = _layer(name)
  bad = []
  for imported, line in _imports(path):
    top = imported.split(".")[0]
    if top in ("experiments", "configs", "tests") and not any(
        name.startswith(a) and top == b for a, b in ALLOWED_OUTSIDE):
      bad.append(f"line {line}: {imported} (outside the library)")
    if top != "lowrl" or own is None:
      continue
    theirs = _layer(imported)
    if theirs is not None and theirs > own:
      bad.append(f"line {line}: {imported} (layer {theirs} above {name}'s {own})")
  assert not bad, f"{name} imports against the layering: {bad}"


def test_precision_imports_nothing_from_the_model():
  imported = [m for m, _ in _imports(ROOT / "lowrl" / "precision.py")]
  assert not [m for m in imported if m.startswith("lowrl.models")]


def test_the_checker_sees_a_violation(tmp_path):
  """The test above can fail: an upward import is found, also inside a function."""
  bad = tmp_path / "bad.py"
  bad.write_text("def f():\n  from lowrl.training import loop\n")
  imported = [m for m, _ in _imports(bad)]
  assert imported == ["lowrl.training"] and _layer("lowrl.training") > _layer("lowrl.models")
