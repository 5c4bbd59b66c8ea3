"""The resolved config of a run: a fingerprint, the workdir copy, --print_config, dotted paths.

The knobs' values are configs/base.py's; their meanings and checks lowrl.training.schema's.

At start the loop writes `<workdir>/config.json` (the resolved config and its fingerprint); a
resume compares the new config with it and refuses a change (listing the changed keys) unless
the caller accepts it explicitly (`--allow_config_change`).
"""
from __future__ import annotations

import difflib
import hashlib
import json
import os
import re
from typing import Any

import ml_collections

from lowrl.models import lora
from lowrl.training import schema
from lowrl.training.run_logs import WorkdirError
from lowrl.training.schema import flatten  # noqa: F401 (run_config.flatten, for callers)

CONFIG_FILE = "config.json"
# Knobs that change what is logged, not what is trained: a resume may change them freely.
# Keys that change no result (`hardware` only selects the memory budget build() checks against).
COSMETIC_KEYS = ("log_every", "num_text_samples", "checkpoint_every", "eval_every", "hardware",
                 "refit_check_every", "checkpoint_keep_fractions", "diagnostics.code_churn",
                 "precompile")


class ConfigError(ValueError):
  """An invalid config (raised by `loop.run` before any compile); the message names the flag."""


class ConfigChangedError(ConfigError):
  """A resume would continue a run under a different config."""


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


def get_path(cfg: ml_collections.ConfigDict, path: str) -> Any:
  """The value at dotted `path` ("rl.loss") of `cfg`."""
  node = cfg
  for p in path.split("."):
    node = node[p]
  return node


def set_path(cfg: ml_collections.ConfigDict, path: str, value: Any, *,
             ignore_type: bool = False) -> None:
  """Sets dotted `path` ("rl.loss") of `cfg` to `value`, as `--config.rl.loss=...` would;
  `ignore_type` for a knob of several types (the simulator's async_rl.lag: an int or 'auto')."""
  parent, _, leaf = path.rpartition(".")
  node = get_path(cfg, parent) if parent else cfg
  if ignore_type:
    with node.ignore_type():
      node[leaf] = value
  else:
    node[leaf] = value


def digest(obj: Any, length: int = 16) -> str:
  """SHA-256 (`length` hex digits) of `obj` as sorted JSON (str() for what JSON cannot hold):
  the one fingerprint of configs, bases and sweep settings."""
  blob = json.dumps(obj, sort_keys=True, default=str)
  return hashlib.sha256(blob.encode()).hexdigest()[:length]


def to_json(cfg: ml_collections.ConfigDict) -> dict[str, Any]:
  """The config as plain JSON (tuples become lists)."""
  return json.loads(cfg.to_json_best_effort(sort_keys=True))


# Knobs added after runs existed, fingerprinted only when set (their value here = off), so that
# every run of a config without them keeps its fingerprint (and its grid lines and workdirs).
OFF_UNLESS_SET = {"sft.outlier_channels": 0, "sft.outlier_gain": 1.0, "model.eos_token": "",
                  "lora.rank": 0, "lora.alpha": 16.0, "lora.targets": lora.ALL_LINEAR,
                  "lora.dtype": "float32", "lora.packed_base": False,
                  "lora.aqn_sigma_start": 0.0, "lora.aqn_sigma_end": 5e-4, "lora.aqn_stages": 10}


def fingerprint(cfg: ml_collections.ConfigDict) -> str:
  """SHA-256 (16 hex digits) of the config minus the cosmetic keys (and the OFF_UNLESS_SET keys
  at their off value)."""
  return digest({k: v for k, v in flatten(to_json(cfg)).items()
                 if k not in COSMETIC_KEYS and OFF_UNLESS_SET.get(k, object()) != v})


def changed_keys(old: dict[str, Any], new: dict[str, Any]) -> list[str]:
  """'key: old -> new' for every non-cosmetic key that differs (or exists on one side only; an
  OFF_UNLESS_SET key absent from a config saved before it existed counts as off)."""
  a, b = flatten(old), flatten(new)
  out = []
  for k in sorted(set(a) | set(b)):
    was, now = (c.get(k, OFF_UNLESS_SET.get(k, "<absent>")) for c in (a, b))
    if k not in COSMETIC_KEYS and was != now:
      out.append(f"{k}: {was!r} -> {now!r}")
  return out


def check_or_write(workdir: str, cfg: ml_collections.ConfigDict, *, resuming: bool,
                   allow_change: bool, write: bool = True,
                   checkpoint_fingerprint: str | None = None) -> list[str]:
  """Compares `cfg` with the workdir's saved config when resuming, then (re)writes it.

  Returns the changed keys (empty when unchanged or fresh). Raises ConfigChangedError if a
  resume changes a non-cosmetic key, or resumes a checkpoint saved under a fingerprint the
  workdir never accepted (`checkpoint_fingerprint`, from the checkpoint's own record: checked
  also when config.json is gone), and `allow_change` is False. An unreadable config.json raises
  WorkdirError (nothing is overwritten).
  """
  path = os.path.join(workdir, CONFIG_FILE)
  new, fp = to_json(cfg), fingerprint(cfg)
  changes: list[str] = []
  accepted: list[str] = []  # every fingerprint the run has been continued under
  if resuming and os.path.exists(path):
    try:
      with open(path) as f:
        saved = json.load(f)
      old = saved["config"]
      accepted = list(saved.get("accepted_fingerprints", [saved.get("fingerprint")]))
    except (OSError, ValueError, KeyError, TypeError) as e:
      raise WorkdirError(
          f"{path} is unreadable ({type(e).__name__}: {str(e)[:120]}); restore it, or move it "
          "aside to resume under this config (the checkpoint's config fingerprint is then "
          "checked instead).") from None
    changes = changed_keys(old, new)
    if changes and not allow_change:
      shown = "; ".join(changes[:8]) + (f" (+{len(changes) - 8} more)" if len(changes) > 8 else "")
      raise ConfigChangedError(
          f"{workdir} holds a run with a different config ({shown}). Resume with the saved "
          f"config ({path}), use a new --workdir, or pass --allow_config_change to continue "
          "under the new one.")
  if (resuming and checkpoint_fingerprint and checkpoint_fingerprint not in accepted + [fp]
      and not allow_change):
    where = "is missing" if not os.path.exists(path) else "does not list it"
    raise ConfigChangedError(
        f"{workdir}'s newest checkpoint was saved under config fingerprint "
        f"{checkpoint_fingerprint}, this config's is {fp} ({path} {where}). Resume with the "
        "config it was saved with, use a new --workdir, or pass --allow_config_change to "
        "continue under this one.")
  if write:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
      json.dump({"fingerprint": fp, "config": new,
                 "accepted_fingerprints": list(dict.fromkeys(accepted + [fp]))},
                f, indent=2, sort_keys=True)
    os.replace(tmp, path)
  return changes


_ASSIGN = re.compile(r"""^\s*(?:c\.([\w.]+)\s*=|"(\w+)":)[^#]*(?:#\s*(.*))?$""")
_COMMENT = re.compile(r"^\s*#\s?(.*)$")


def comment_docs(source: str, prefix: str = "") -> dict[str, str]:
  """{key: meaning} from a config file's source: the comment block above an assignment
  (`c.key = ...` or a dict entry `"key": ...`) plus its trailing comment. For the knobs a config
  file adds itself (e.g. the sweep's grid); the schema's knobs carry their meanings."""
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


def describe(cfg: ml_collections.ConfigDict, docs: dict[str, str] | None = None) -> str:
  """Every knob as `--config.KEY=VALUE`, one a line, with its meaning from `docs` (default: the
  training loop's schema) (what `--print_config` shows)."""
  docs = schema.TRAIN.docs() if docs is None else docs
  lines = []
  for k, v in flatten(cfg).items():
    doc = docs.get(k)
    lines.append(f"--config.{k}={v!r}" + (f"  # {doc}" if doc else ""))
  return "\n".join(lines)
