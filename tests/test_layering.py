"""No import in lowrl runs against the layering documented in ARCHITECTURE.md.

The check reads every module's import statements (the AST, so imports inside functions count
too) and its dynamic imports (`importlib.import_module(...)`, `import_module(...)`,
`__import__(...)` of a literal name, or of an f-string's literal prefix up to its last dot), and
compares the layer of the importing module with the layer of each lowrl module it imports: a
module may import its own layer or lower ones, never a higher one. A dynamic import of a name
with no literal package prefix cannot be checked, so it is a violation too.
"""
from __future__ import annotations

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]

# Lowest first; ARCHITECTURE.md "Layering" shows the same order.
LAYERS = (
    ("lowrl.quant", "lowrl.hardware", "lowrl.distributed", "lowrl.metrics", "lowrl.user_cache",
     "lowrl.analysis", "lowrl.grid"),
    ("lowrl.precision",),
    ("lowrl.models",),
    ("lowrl.sharding", "lowrl.checkpoints", "lowrl.memory", "lowrl.tasks"),
    ("lowrl.sampling",),
    ("lowrl.rl",),
    ("lowrl.training",),
    ("lowrl.asyncrl",),
)
# Data, not code: the named precision recipes are read from configs/<recipe>.py (a dynamic
# import, `importlib.import_module(f"configs.{name}")`; test_the_checker_sees_dynamic_imports).
ALLOWED_OUTSIDE = {("lowrl.precision", "configs")}
# A dynamic import whose name has no literal package prefix.
UNKNOWN = "<computed name>"


def _layer(module: str) -> int | None:
  for i, packages in enumerate(LAYERS):
    if any(module == p or module.startswith(p + ".") for p in packages):
      return i
  return None


def _module_name(path: pathlib.Path) -> str:
  parts = path.relative_to(ROOT).with_suffix("").parts
  return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _dynamic_import_name(node: ast.Call) -> str | None:
  """The module a call `importlib.import_module(x)` / `import_module(x)` / `__import__(x)`
  imports: x itself when a literal, an f-string's literal prefix up to its last dot
  (f"configs.{name}" imports from "configs"), UNKNOWN otherwise; None for any other call."""
  func = node.func
  called = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
  if called not in ("import_module", "__import__") or not node.args:
    return None
  arg = node.args[0]
  if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
    return arg.value
  if isinstance(arg, ast.JoinedStr):
    prefix = ""
    for part in arg.values:
      if not (isinstance(part, ast.Constant) and isinstance(part.value, str)):
        break
      prefix += part.value
    package = prefix.rpartition(".")[0]
    return package or UNKNOWN
  return UNKNOWN


def _imports(path: pathlib.Path, source: str | None = None) -> list[tuple[str, int]]:
  """(imported module, line) of every absolute import in the file (or in `source`), dynamic
  imports included."""
  out = []
  text = path.read_text() if source is None else source
  for node in ast.walk(ast.parse(text, str(path))):
    if isinstance(node, ast.Import):
      out += [(a.name, node.lineno) for a in node.names]
    elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
      # `from lowrl import sharding` imports the module lowrl.sharding.
      out += [(f"{node.module}.{a.name}" if node.module == "lowrl" else node.module,
               node.lineno) for a in node.names]
    elif isinstance(node, ast.Call) and (name := _dynamic_import_name(node)) is not None:
      out.append((name, node.lineno))
  return out


def _violations(name: str, path: pathlib.Path, source: str | None = None) -> list[str]:
  """The imports of module `name` (file `path`, or `source`) against the layering."""
  own = _layer(name)
  bad = []
  for imported, line in _imports(path, source):
    top = imported.split(".")[0]
    if imported == UNKNOWN:
      bad.append(f"line {line}: a dynamic import of a computed name (use a literal package)")
      continue
    if top in ("experiments", "configs", "tests") and not any(
        name.startswith(a) and top == b for a, b in ALLOWED_OUTSIDE):
      bad.append(f"line {line}: {imported} (outside the library)")
    if top != "lowrl" or own is None:
      continue
    theirs = _layer(imported)
    if theirs is not None and theirs > own:
      bad.append(f"line {line}: {imported} (layer {theirs} above {name}'s {own})")
  return bad


MODULES = sorted((ROOT / "lowrl").rglob("*.py"))


def test_every_module_has_a_layer():
  missing = [_module_name(p) for p in MODULES
             if _module_name(p) != "lowrl" and _layer(_module_name(p)) is None]
  assert not missing, f"add these to LAYERS (and ARCHITECTURE.md): {missing}"


@pytest.mark.parametrize("path", MODULES, ids=lambda p: _module_name(p))
def test_imports_follow_the_layering(path):
  name = _module_name(path)
  bad = _violations(name, path)
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


def test_the_checker_sees_dynamic_imports():
  """The one allowed import from outside the library is a dynamic one, and the checker finds it."""
  path = ROOT / "lowrl" / "precision.py"
  assert "configs" in [m for m, _ in _imports(path)]
  assert not _violations("lowrl.precision", path)  # found, and allowed


@pytest.mark.parametrize("source, found", [
    ('import importlib\ndef f():\n  return importlib.import_module("lowrl.training.loop")\n',
     "lowrl.training.loop"),
    ('from importlib import import_module\nm = import_module(f"lowrl.asyncrl.{0}")\n',
     "lowrl.asyncrl"),
    ('m = __import__("lowrl.sampling")\n', "lowrl.sampling"),
    ('import importlib\nm = importlib.import_module(f"configs.{1}")\n', "configs"),
    ('import importlib\nm = importlib.import_module(name)\n', UNKNOWN),
    ('import importlib\nm = importlib.import_module(f"{pkg}.x")\n', UNKNOWN),
])
def test_an_unlisted_dynamic_upward_import_fails(source, found, tmp_path):
  """A synthetic module of the models layer importing upward (or from configs, which only
  lowrl.precision may) dynamically is a violation."""
  path = tmp_path / "mod.py"
  assert found in [m for m, _ in _imports(path, source)]
  assert _violations("lowrl.models.synthetic", path, source)
  # Not a dynamic import: a method of the same name on another object with no argument.
  assert not _imports(path, "x.import_module()\n")
