"""Command-line plumbing shared by the absl binaries: config files, --help, one-line errors.

The binaries run from the repository root (`python -m experiments.train`), where config files are
paths (`--config=configs/bf16.py`) and import `configs.base` as a package of the working
directory; nothing here edits sys.path. A config error is one line on stderr naming the flag
(with a "did you mean" for a misspelt `--config.*` key) or the file, and exit status 2, not a
traceback. `--help` prints the binary's docstring and its flags on stdout and exits 0.
"""
from __future__ import annotations

import dataclasses
import importlib.util
import os
import sys
import textwrap
from typing import Any, Callable, NoReturn, Sequence

from absl import flags

from lowrl import precision, user_cache
from lowrl.training import exits, run_config


HELP_ARGS = ("--help", "-h", "-?", "--helpshort")
HELPFULL_ARGS = ("--helpfull",)


def usage(doc: str, module: str) -> str:
  """The --help text: the binary's docstring, its run flags and own flags, how to see the knobs."""
  def flag_lines(name: str) -> list[str]:  # absl's help text of a module's flags, minus headings
    return [line for line in flags.FLAGS.module_help(name).splitlines() if line.startswith(" ")]
  footer = ("Every knob of the config file is a flag too, --config.KEY=VALUE: --print_config lists "
            "them with their values and meanings. --helpfull lists absl's and JAX's flags too.")
  return "\n".join([(doc or "").strip(), "", "flags:", *flag_lines(__name__), *flag_lines(module),
                    "", textwrap.fill(footer, 80)])


def _help_requested(argv: Sequence[str]) -> str | None:
  """"short" or "full" when argv asks for help (before any `--` ends the flags), else None."""
  for arg in argv[1:]:
    if arg == "--":
      return None
    if arg in HELP_ARGS:
      return "short"
    if arg in HELPFULL_ARGS:
      return "full"
  return None


def fail(message: str) -> NoReturn:
  """Prints `error: message` (one line) and exits with status 2 (a usage error), once the
  background threads are done (`exits.exit_with_line`: nothing prints after the line)."""
  exits.exit_with_line(exits.error_line(message), exits.USAGE)


def innermost(e: BaseException) -> BaseException:
  """The root cause of a chain of exceptions (config loaders wrap the real error twice)."""
  while e.__cause__ is not None:
    e = e.__cause__
  return e


def make_flags_parser(default_spec: str, doc: str = "",
                      module: str = "__main__") -> Callable[[list[str]], list[str]]:
  """An absl `flags_parser` that resolves --config paths, answers --help (exit 0) and turns a
  flag error into one line (exit 2). `doc` and `module` name the binary for --help."""
  def parse(argv: list[str]) -> list[str]:
    wanted = _help_requested(argv)
    if wanted is not None:
      # absl's own --help prints only "Try --helpfull" under a console script and exits 1.
      print(usage(doc, module) if wanted == "short" else
            f"{(doc or '').strip()}\n\nflags:\n{flags.FLAGS.get_help()}", flush=True)
      sys.exit(0)
    try:
      return flags.FLAGS(argv)
    except flags.Error as e:
      if not isinstance(innermost(e), flags.Error) or _TRACEBACK in str(e):
        # A config file's error, wrapped by absl (and by ml_collections as traceback text).
        config_error(e, argv, default_spec)
      hint = " (--help lists the flags)" if isinstance(e, flags.UnrecognizedFlagError) else ""
      fail(f"{e}{hint}")
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


_TRACEBACK = "Traceback (most recent call last)"


def _shown(path: str) -> str:
  """`path` as the user would type it: relative to the working directory when inside it."""
  cwd = os.getcwd()
  return os.path.relpath(path, cwd) if path.startswith(cwd + os.sep) else path


def missing_file_message(spec: str, default_spec: str) -> str:
  """The one-line error for a --config file that does not exist, naming what exists."""
  path = spec.partition(":")[0]
  return (f"--config={spec}: no config file {path!r} in the working directory; "
          f"a recipe is configs/<name>.py or configs/base.py:<name> with <name> one of "
          f"{', '.join(precision.RECIPES)} (this binary's default: {_shown(default_spec)}).")


def error_line(root: BaseException) -> str:
  """One line for an error a config file raised: the last line of a traceback ml_collections
  folded into the message, the type name unless it is a plain ValueError."""
  text = str(root).strip()
  if _TRACEBACK in text:  # "Error whilst parsing config file: Traceback ...\nValueError: msg"
    return text.splitlines()[-1].strip().removeprefix("ValueError: ")
  if isinstance(root, ModuleNotFoundError) and root.name in ("configs", "experiments"):
    return (f"no module {root.name!r}: run the binary from the repository root "
            "(python -m experiments.train ...), where the config files import configs.base.")
  if isinstance(root, AttributeError) and "get_config" in text:
    return "the file defines no get_config(); a config file's get_config() returns its ConfigDict."
  line = " ".join(text.split())
  return line if type(root) is ValueError else f"{type(root).__name__}: {line}"


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
  if not os.path.isfile(spec.partition(":")[0]):
    fail(missing_file_message(_shown(spec), default_spec))
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
  fail(f"--config={_shown(spec)}: {error_line(root)}")


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
  --print_config and --compile_cache (absl flag holders); `doc` and `module` name the binary for
  --help."""
  default_spec: str
  config: Any
  workdir: Any
  print_config: Any
  compile_cache: Any
  doc: str = ""
  module: str = "__main__"

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
    return make_flags_parser(self.default_spec, self.doc, self.module)


def define_run_flags(config_file: str, workdir: str, workdir_help: str) -> RunFlags:
  """Defines --config (`configs/<config_file>` by default; `path[:arg]` and --config.KEY=VALUE
  overrides), --workdir, --print_config and --compile_cache. Call at import time of a binary,
  before app.run: the calling module's docstring and flags are what its --help prints."""
  from ml_collections import config_flags  # noqa: PLC0415 - only the binaries need it

  caller = sys._getframe(1).f_globals  # noqa: SLF001 - the binary defining its flags
  # absl files the flags of `python -m pkg.mod` (module __main__) under sys.argv[0].
  module = sys.argv[0] if caller["__name__"] == "__main__" else caller["__name__"]

  # configs/ sits next to the binary's experiments/ directory.
  repo = os.path.dirname(os.path.dirname(os.path.abspath(caller["__file__"])))
  default_spec = os.path.join(repo, "configs", config_file)
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
      user_cache.define_compile_cache_flag(module), doc=caller.get("__doc__") or "",
      module=module)
