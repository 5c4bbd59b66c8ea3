"""The resolved config of a run: checks that name the flag, a fingerprint, the workdir copy.

At start the loop writes `<workdir>/config.json` (the resolved config and its fingerprint); a
resume compares the new config with it and refuses a change (listing the changed keys) unless
the caller accepts it explicitly (`--allow_config_change`).
"""
from __future__ import annotations

import difflib
import hashlib
import inspect
import json
import math
import os
import re
from typing import Any

import ml_collections

from lowrl.training.schedule import AsyncSchedule
from lowrl.rl.corrections import CORRECTION_LEVELS, CORRECTION_MODES
from lowrl.rl.kl import KL_ESTIMATORS
from lowrl.rl.losses import AGGREGATIONS, LOSSES
from lowrl.sampling import SamplingConfig
from lowrl.training.rl_update import OLD_LOGP_SOURCES

CONFIG_FILE = "config.json"
# Knobs that change what is logged, not what is trained: a resume may change them freely.
COSMETIC_KEYS = ("log_every", "num_text_samples", "checkpoint_every", "eval_every")


class ConfigError(ValueError):
  """An invalid config (raised by `loop.run` before any compile); the message names the flag."""


class ConfigChangedError(ConfigError):
  """A resume would continue a run under a different config."""


def flatten(cfg: ml_collections.ConfigDict | dict, prefix: str = "") -> dict[str, Any]:
  """{"rl.loss": "grpo", ...}: every leaf of the config by its dotted flag name."""
  out = {}
  for k, v in (cfg.items() if hasattr(cfg, "items") else []):
    name = f"{prefix}{k}"
    if isinstance(v, (ml_collections.ConfigDict, dict)) and len(v):
      out.update(flatten(v, name + "."))
    else:
      out[name] = v.to_dict() if isinstance(v, ml_collections.ConfigDict) else v
  return out


def did_you_mean(name: str, cfg: ml_collections.ConfigDict) -> str:
  """' (did you mean --config.X?)' for the closest existing key, or ''."""
  names = list(flatten(cfg))
  leaf = name.rpartition(".")[2]
  close = [n for n in names if n.rpartition(".")[2] == leaf]  # right key, wrong section
  close = close or difflib.get_close_matches(name, names, n=1, cutoff=0.6)
  if not close:  # a wrong last part: match it among the keys of its section
    section = name.rpartition(".")[0]
    close = difflib.get_close_matches(name, [n for n in names if n.startswith(section)], n=1,
                                      cutoff=0.3)
  return f" (did you mean --config.{close[0]}?)" if close else ""


def _one_of(name: str, value: Any, allowed: tuple) -> None:
  if value not in allowed:
    raise ValueError(f"--config.{name}={value!r}: use one of {', '.join(map(repr, allowed))}.")


def check_values(cfg: ml_collections.ConfigDict) -> None:
  """Raises ValueError naming the flag for non-finite numbers and out-of-range choices.

  Complements the module-level checks (optimizer, rl_update, sampler): these are the knobs whose
  errors otherwise surface without their flag name, or only after a compile.
  """
  for name, value in flatten(cfg).items():
    if isinstance(value, float) and not math.isfinite(value):
      raise ValueError(f"--config.{name}={value}: must be a finite number.")
  rl, a = cfg.rl, cfg.async_rl
  _one_of("rl.loss", rl.loss, LOSSES)
  _one_of("rl.correction", rl.correction, CORRECTION_MODES)
  _one_of("rl.correction_level", rl.correction_level, CORRECTION_LEVELS)
  _one_of("rl.kl_estimator", rl.kl_estimator, KL_ESTIMATORS)
  _one_of("rl.aggregation", rl.aggregation, ("",) + AGGREGATIONS)
  _one_of("rl.old_logp_source", rl.old_logp_source, OLD_LOGP_SOURCES)
  try:  # the sampler's own checks, reported under the rl.* flag names
    SamplingConfig(max_new_tokens=rl.max_new_tokens, temperature=rl.temperature, top_k=rl.top_k,
                   top_p=rl.top_p)
  except ValueError as e:
    raise ValueError(f"--config.rl.{e}") from None
  try:  # the schedule's own checks, reported under the async_rl.* flag names
    AsyncSchedule(lag=a.lag, sync_every=a.sync_every, lag_distribution=a.lag_distribution)
  except ValueError as e:
    raise ValueError(f"--config.async_rl.{e}") from None
  if cfg.max_skipped_steps < 1:
    raise ValueError(f"--config.max_skipped_steps={cfg.max_skipped_steps}: must be >= 1.")


def to_json(cfg: ml_collections.ConfigDict) -> dict[str, Any]:
  """The config as plain JSON (tuples become lists)."""
  return json.loads(cfg.to_json_best_effort(sort_keys=True))


def fingerprint(cfg: ml_collections.ConfigDict) -> str:
  """SHA-256 (16 hex digits) of the config minus the cosmetic keys."""
  flat = {k: v for k, v in flatten(to_json(cfg)).items() if k not in COSMETIC_KEYS}
  return hashlib.sha256(json.dumps(flat, sort_keys=True).encode()).hexdigest()[:16]


def changed_keys(old: dict[str, Any], new: dict[str, Any]) -> list[str]:
  """'key: old -> new' for every non-cosmetic key that differs (or exists on one side only)."""
  a, b = flatten(old), flatten(new)
  out = []
  for k in sorted(set(a) | set(b)):
    if k not in COSMETIC_KEYS and a.get(k, "<absent>") != b.get(k, "<absent>"):
      out.append(f"{k}: {a.get(k, '<absent>')!r} -> {b.get(k, '<absent>')!r}")
  return out


def check_or_write(workdir: str, cfg: ml_collections.ConfigDict, *, resuming: bool,
                   allow_change: bool, write: bool = True) -> list[str]:
  """Compares `cfg` with the workdir's saved config when resuming, then (re)writes it.

  Returns the changed keys (empty when unchanged or fresh). Raises ConfigChangedError if a
  resume changes a non-cosmetic key and `allow_change` is False.
  """
  path = os.path.join(workdir, CONFIG_FILE)
  new = to_json(cfg)
  changes: list[str] = []
  if resuming and os.path.exists(path):
    with open(path) as f:
      old = json.load(f)["config"]
    changes = changed_keys(old, new)
    if changes and not allow_change:
      shown = "; ".join(changes[:8]) + (f" (+{len(changes) - 8} more)" if len(changes) > 8 else "")
      raise ConfigChangedError(
          f"{workdir} holds a run with a different config ({shown}). Resume with the saved "
          f"config ({path}), use a new --workdir, or pass --allow_config_change to continue "
          "under the new one.")
  if write:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
      json.dump({"fingerprint": fingerprint(cfg), "config": new}, f, indent=2, sort_keys=True)
    os.replace(tmp, path)
  return changes


_ASSIGN = re.compile(r"""^\s*(?:c\.([\w.]+)\s*=|"(\w+)":)[^#]*(?:#\s*(.*))?$""")
_COMMENT = re.compile(r"^\s*#\s?(.*)$")


def comment_docs(source: str, prefix: str = "") -> dict[str, str]:
  """{key: meaning} from a config-building source: the comment block above an assignment
  (`c.key = ...` or a dict entry `"key": ...`) plus its trailing comment."""
  docs, block = {}, []
  for line in source.splitlines():
    if m := _COMMENT.match(line):
      block.append(m.group(1).strip())
      continue
    if m := _ASSIGN.match(line):
      text = " ".join(block + ([m.group(3).strip()] if m.group(3) else []))
      if text:
        docs[prefix + (m.group(1) or m.group(2))] = text
    block = []
  return docs


def knob_docs() -> dict[str, str]:
  """Meanings of the knobs, from the comments of the config sources (configs/base.py and the
  defaults it takes from lowrl.training)."""
  from lowrl.training import optimizer, rl_update  # noqa: F401 (their sources are read)
  root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  docs = {}
  for module, prefix in ((optimizer, "optimizer."), (rl_update, "rl.")):
    fn = module.default_optimizer_config if module is optimizer else module.default_rl_config
    docs.update(comment_docs(inspect.getsource(fn), prefix))
  docs.update(_precision_docs())
  base = os.path.join(root, "configs", "base.py")
  if os.path.exists(base):
    with open(base) as f:
      docs.update(comment_docs(f.read()))
  return docs


def _precision_docs() -> dict[str, str]:
  """`precision.<knob>` meanings from the knob list of `lowrl.precision.recipe`'s docstring."""
  from lowrl import precision
  docs, key = {}, None
  for line in (precision.recipe.__doc__ or "").split("Knobs", 1)[-1].splitlines()[1:]:
    if m := re.match(r"^ {4}(\w+): (.*)$", line):
      key = "precision." + m.group(1)
      docs[key] = m.group(2).strip()
    elif key and line.startswith(" " * 6) and line.strip():
      docs[key] += " " + line.strip()
    else:
      key = None
  return docs


def describe(cfg: ml_collections.ConfigDict, docs: dict[str, str] | None = None) -> str:
  """Every knob as `--config.KEY=VALUE`, one a line, with its meaning where the config sources
  comment it (what `--print_config` shows)."""
  docs = knob_docs() if docs is None else docs
  lines = []
  for k, v in flatten(cfg).items():
    # The simulator nests the loop's knobs (sim.rl.steps is rl.steps): fall back to those names.
    doc = docs.get(k) or docs.get(k.partition(".")[2])
    lines.append(f"--config.{k}={v!r}" + (f"  # {doc}" if doc else ""))
  return "\n".join(lines)
