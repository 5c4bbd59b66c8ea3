"""Command-line plumbing shared by the absl binaries: config-file paths and one-line flag errors.

A config error is one line on stderr naming the flag (with a "did you mean" for a misspelt
`--config.*` key) and exit status 2, not a traceback.
"""
from __future__ import annotations

import dataclasses
import importlib.util
import os
import sys
from typing import Any, Callable, NoReturn, Sequence

from absl import flags

from lowrl import user_cache
from lowrl.training import run_config

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if REPO not in sys.path:
  # Config files import `configs.base`, and absl loads the default config file when the flag is
  # defined: the repository must be importable before that, from any working directory.
  sys.path.append(REPO)


def resolve_config_paths(argv: Sequence[str]) -> list[str]:
  """`--config=configs/x.py[:arg]` relative to the repository when it is not relative to the
  working directory, so the binaries run from anywhere."""
  out = []
  for arg in argv:
    if arg.startswith("--config=") and not arg.startswith("--config."):
      path, sep, rest = arg[len("--config="):].partition(":")
      if path and not os.path.exists(path) and os.path.exists(os.path.join(REPO, path)):
        arg = f"--config={os.path.join(REPO, path)}{sep}{rest}"
    out.append(arg)
  return out


def fail(message: str) -> NoReturn:
  """Prints `error: message` (one line) and exits with status 2 (a usage error)."""
  print(f"error: {' '.join(message.split())}", file=sys.stderr, flush=True)
  sys.exit(2)


def innermost(e: BaseException) -> BaseException:
  """The root cause of a chain of exceptions (config loaders wrap the real error twice)."""
  while e.__cause__ is not None:
    e = e.__cause__
  return e


def make_flags_parser(default_spec: str) -> Callable[[list[str]], list[str]]:
  """An absl `flags_parser` that resolves --config paths and turns a flag error into one line."""
  def parse(argv: list[str]) -> list[str]:
    argv = resolve_config_paths(argv)
    try:
      return flags.FLAGS(argv)
    except flags.Error as e:
      if not isinstance(innermost(e), flags.Error):  # a config file error wrapped by absl
        config_error(e, argv, default_spec)
      fail(str(e))
    except Exception as e:  # noqa: BLE001 - config files raise anything; all are usage errors
      config_error(e, argv, default_spec)
  return parse


def _load_config_file(spec: str) -> Any:
  """`get_config(arg)` of a `path[:arg]` config file, without command-line overrides."""
  path, _, arg = spec.partition(":")
  module_spec = importlib.util.spec_from_file_location("_lowrl_config_file", path)
  module = importlib.util.module_from_spec(module_spec)
  module_spec.loader.exec_module(module)
  return module.get_config(arg) if arg else module.get_config()


def config_error(e: BaseException, argv: Sequence[str], default_spec: str) -> NoReturn:
  """Reports a config-loading failure in one line and exits 2.

  ml_collections reports an unknown key without its path (and while the flag is defined), so
  the unknown `--config.KEY` is found here by checking each override against the plain file.
  """
  root = innermost(e)
  spec = default_spec
  for arg in argv:
    if arg.startswith("--config="):
      spec = arg[len("--config="):]
  try:
    base = _load_config_file(spec)
  except Exception:  # noqa: BLE001 - the file itself is broken: report its error below
    base = None
  if base is not None:
    known = set(run_config.flatten(base))
    for arg in argv:
      if arg.startswith("--config."):
        key = arg[len("--config."):].partition("=")[0]
        if key not in known and not any(k.startswith(key + ".") for k in known):
          fail(f"unknown flag --config.{key}{run_config.did_you_mean(key, base)}; "
               "--print_config lists every --config.* key.")
  text = str(root).strip()
  fail(f"--config={spec}: {type(root).__name__}: {text.splitlines()[-1] if text else ''}")


def config_value(holder: Any, argv: Sequence[str], default_spec: str) -> Any:
  """`holder.value` (the config with its --config.* overrides), or a one-line error (exit 2)."""
  try:
    cfg = holder.value
    cfg.keys()  # a file that failed to load gives a placeholder that raises on first use
    return cfg
  except Exception as e:  # noqa: BLE001 - config files raise anything; all are usage errors
    config_error(e, argv, default_spec)


@dataclasses.dataclass(frozen=True)
class RunFlags:
  """The flags every binary defines: its config file (`default_spec`), --config, --workdir,
  --print_config and --compile_cache (absl flag holders)."""
  default_spec: str
  config: Any
  workdir: Any
  print_config: Any
  compile_cache: Any

  def config_value(self) -> Any:
    """The config with its --config.* overrides, or a one-line error (exit 2)."""
    return config_value(self.config, sys.argv, self.default_spec)

  def show_config(self, cfg: Any, schema_docs: dict[str, str] | None = None) -> None:
    """Prints every knob of `cfg` with its value and meaning: `schema_docs`, then the comments of
    the binary's default config file."""
    docs = dict(schema_docs or {})
    with open(self.default_spec) as f:
      docs.update(run_config.comment_docs(f.read()))
    print(run_config.describe(cfg, docs))

  def start(self, argv: Sequence[str], schema_docs: dict[str, str] | None = None) -> Any | None:
    """The config a binary's `main(argv)` runs; None when --print_config printed it instead.
    Stray positional arguments are a one-line error. Turns on the compilation cache
    (`--compile_cache`, lowrl.user_cache) before anything compiles."""
    if len(argv) > 1:
      fail(f"unexpected arguments {list(argv[1:])}; flags look like --workdir=DIR.")
    cfg = self.config_value()
    if self.print_config.value:
      self.show_config(cfg, schema_docs)
      return None
    user_cache.enable_compile_cache(self.compile_cache.value)
    return cfg

  def parser(self) -> Callable[[list[str]], list[str]]:
    """The `flags_parser` for `absl.app.run` (one-line flag errors)."""
    return make_flags_parser(self.default_spec)


def define_run_flags(config_file: str, workdir: str, workdir_help: str) -> RunFlags:
  """Defines --config (`configs/<config_file>` by default; `path[:arg]` and --config.KEY=VALUE
  overrides), --workdir, --print_config and --compile_cache. Call at import time of a binary,
  before app.run."""
  from ml_collections import config_flags  # noqa: PLC0415 - only the binaries need it

  default_spec = os.path.join(REPO, "configs", config_file)
  sys.argv = resolve_config_paths(sys.argv)
  try:  # ml_collections loads the config file and checks the overrides right here
    config = config_flags.DEFINE_config_file(
        "config", default_spec,
        "Path to an ml_collections config file (optionally `path:arg`, e.g. configs/base.py:bf16); "
        "override its knobs with --config.KEY=VALUE (see --print_config).")
  except Exception as e:  # noqa: BLE001 - any failure here is a usage error
    config_error(e, sys.argv, default_spec)
  return RunFlags(
      default_spec, config, flags.DEFINE_string("workdir", workdir, workdir_help),
      flags.DEFINE_bool("print_config", False,
                        "Print every --config.* knob with its value and meaning, and exit."),
      user_cache.define_compile_cache_flag())
