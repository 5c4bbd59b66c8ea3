"""The config-schema machinery: knobs (name, meaning, check), sections, schemas, flat keys.

A `Section` is a table of `Knob`s plus the checks that relate several of them; a `Schema` is the
ordered sections of one run kind (the loop's: lowrl.training.schema.TRAIN). `Schema.validate`
raises a one-line ValueError naming the `--config.*` flag and the fix; `Schema.docs()` gives the
meanings `--print_config` shows.
"""
from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Iterable
from typing import Any, Callable

import ml_collections

# ----------------------------------------------------------------------------------------------
# Checks of one knob: (flag, value) -> None, raising ValueError that names --config.<flag>.


def as_flags(text: str, section: str, fields: Iterable[str] = ()) -> str:
  """A library type's error message in flag terms: every bare `section.knob` mention becomes
  `--config.section.knob`, and a message that starts with one of the section's `fields` (a type
  names its own field: "clip_eps_low must be ...") starts with its flag."""
  text = re.sub(rf"(?<![\w.-]){re.escape(section)}\.(?=\w)", f"--config.{section}.", text)
  first = re.match(r"\w+", text)
  if first and first.group() in set(fields):
    return f"--config.{section}.{text}"
  return text


@dataclasses.dataclass(frozen=True)
class OneOf:
  """The value is one of `choices`."""

  choices: tuple

  def __call__(self, flag: str, value: Any) -> None:
    if value not in self.choices:
      raise ValueError(f"--config.{flag}={value!r}: use one of "
                       f"{', '.join(map(repr, self.choices))}.")


@dataclasses.dataclass(frozen=True)
class AtLeast:
  """value >= lo (value > lo when `strict`); None passes when `optional`."""

  lo: float
  strict: bool = False
  optional: bool = False
  hint: str = ""  # why, or what the boundary value means, e.g. "0 = never"

  def __call__(self, flag: str, value: Any) -> None:
    if value is None and self.optional:
      return
    if value is None or not (value > self.lo if self.strict else value >= self.lo):
      bound = f"{'>' if self.strict else '>='} {self.lo}" + (" or None" if self.optional else "")
      raise ValueError(f"--config.{flag}={value!r}: must be {bound}"
                       + (f" ({self.hint})" if self.hint else "") + ".")


@dataclasses.dataclass(frozen=True)
class Below:
  """lo <= value < hi."""

  lo: float
  hi: float

  def __call__(self, flag: str, value: Any) -> None:
    if not self.lo <= value < self.hi:
      raise ValueError(f"--config.{flag}={value!r}: must be in [{self.lo}, {self.hi}).")


Check = Callable[[str, Any], None]
# A check of a whole section: (its flag prefix, e.g. "rl", its ConfigDict) -> None.
SectionCheck = Callable[[str, ml_collections.ConfigDict], None]


class _Unset:
  def __repr__(self) -> str:
    return "UNSET"


# The default of a knob whose run kind keeps its values in a config file (the loop's).
UNSET: Any = _Unset()


@dataclasses.dataclass(frozen=True)
class Knob:
  """One `--config.*` knob.

  Attributes:
    name: key within its section.
    default: value of a new config for a run kind whose values are the table's (the simulator's;
      ignored when `factory` is given); UNSET for the loop's knobs (configs/base.py).
    doc: one-line meaning (choices are appended from a OneOf check).
    check: per-value check, None when the section's checks (or a type it builds) cover it.
    factory: builds a fresh default (mutable values, typed placeholders).
  """

  name: str
  default: Any
  doc: str
  check: Check | None = None
  factory: Callable[[], Any] | None = None

  @property
  def meaning(self) -> str:
    if isinstance(self.check, OneOf):
      return f"{self.doc}: {' | '.join(map(str, self.check.choices))}"
    return self.doc

  def new_default(self) -> Any:
    return self.factory() if self.factory is not None else self.default


def knob(name: str, doc: str, check: Check | None = None) -> Knob:
  """A knob without a value in the table: its run kind's config file sets it."""
  return Knob(name, UNSET, doc, check)


@dataclasses.dataclass(frozen=True)
class Section:
  """A group of knobs under `name` ("" = the config's top level).

  `external`: the values come from elsewhere (the precision recipe), not from `default`s, and are
  checked by their owner; the table only documents them.
  """

  name: str
  knobs: tuple[Knob, ...]
  checks: tuple[SectionCheck, ...] = ()
  external: bool = False

  def flag(self, knob: str) -> str:
    return f"{self.name}.{knob}" if self.name else knob

  def only(self, *names: str) -> Section:
    """This section with only the knobs `names` (in table order): a run kind that lacks the rest."""
    unknown = set(names) - {k.name for k in self.knobs}
    if unknown:
      raise ValueError(f"section {self.name!r} has no knobs {sorted(unknown)}.")
    return dataclasses.replace(self, knobs=tuple(k for k in self.knobs if k.name in names))

  def extended(self, *knobs: Knob, checks: tuple[SectionCheck, ...] = ()) -> Section:
    """This section with more knobs (appended) and checks."""
    return dataclasses.replace(self, knobs=self.knobs + knobs, checks=self.checks + checks)

  def with_defaults(self, **defaults: Any) -> Section:
    """This section with other defaults (another run kind's), e.g. RL.with_defaults(steps=400)."""
    unknown = set(defaults) - {k.name for k in self.knobs}
    if unknown:
      raise ValueError(f"section {self.name!r} has no knobs {sorted(unknown)}.")
    return dataclasses.replace(self, knobs=tuple(
        dataclasses.replace(k, default=defaults[k.name], factory=None) if k.name in defaults
        else k for k in self.knobs))

  def defaults(self) -> ml_collections.ConfigDict:
    """The section's knobs with fresh defaults (a table that holds every value)."""
    unset = [self.flag(k.name) for k in self.knobs if k.factory is None and k.default is UNSET]
    if unset:
      raise ValueError(f"the schema holds no value of {', '.join(unset)}: the run kind's config "
                       "file does (the loop's: configs/base.py).")
    return ml_collections.ConfigDict({k.name: k.new_default() for k in self.knobs})

  def validate(self, node: ml_collections.ConfigDict) -> None:
    """Runs the knob checks, then the section checks, on the section's ConfigDict `node`."""
    for k in self.knobs:
      if k.check is not None:
        k.check(self.flag(k.name), node[k.name])
    for check in self.checks:
      check(self.name, node)


@dataclasses.dataclass(frozen=True)
class Schema:
  """The ordered sections of one run kind."""

  sections: tuple[Section, ...]

  def section(self, name: str) -> Section:
    return next(s for s in self.sections if s.name == name)

  def defaults(self, **external: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
    """A new config of every section's defaults; the external sections are given by name
    (e.g. precision=lowrl.precision.recipe("bf16"))."""
    c = ml_collections.ConfigDict()
    for s in self.sections:
      if s.external:
        if s.name not in external:
          raise ValueError(f"the {s.name} section comes from outside the schema; pass "
                           f"{s.name}=... to defaults().")
        c[s.name] = external.pop(s.name)
      elif s.name:
        c[s.name] = s.defaults()
      else:
        for k, v in s.defaults().items():
          c[k] = v
    if external:
      raise ValueError(f"no external sections {sorted(external)} in the schema.")
    return c

  def validate(self, cfg: ml_collections.ConfigDict) -> None:
    """Raises a one-line ValueError naming the flag and the fix for the first bad value (or a
    knob the config lacks or the schema does not know)."""
    self.check_keys(cfg)
    for name, value in flatten(cfg).items():
      if isinstance(value, float) and not math.isfinite(value):
        raise ValueError(f"--config.{name}={value}: must be a finite number.")
    for s in self.sections:
      if not s.external:
        s.validate(cfg[s.name] if s.name else cfg)

  def check_keys(self, cfg: ml_collections.ConfigDict) -> None:
    """Every knob of the schema is in `cfg` and every key of `cfg` is a knob (or a section)."""
    expected: dict[str, tuple[str, ...]] = {"": tuple(s.name for s in self.sections if s.name)}
    for s in self.sections:
      expected[s.name] = expected.get(s.name, ()) + tuple(k.name for k in s.knobs)
    for name, keys in expected.items():
      if name and self.section(name).external:
        continue  # checked by its owner (precision.make_policy)
      node = cfg[name] if name else cfg
      prefix = f"{name}." if name else ""
      missing = [k for k in keys if k not in node]
      if missing:
        raise ValueError(f"--config.{prefix}{missing[0]} is missing from the config: add it to "
                         "the config file (the loop's defaults: configs/base.py).")
      unknown = sorted(set(node.keys()) - set(keys))
      if unknown:
        raise ValueError(f"--config.{prefix}{unknown[0]} is not a knob of the schema "
                         f"(lowrl.training.schema); drop it, or add its knob(...) line there.")

  def docs(self, prefix: str = "") -> dict[str, str]:
    """{flag: meaning} of every knob (flags prefixed by `prefix`, e.g. "sim.")."""
    return {prefix + s.flag(k.name): k.meaning for s in self.sections for k in s.knobs}


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


POSITIVE = AtLeast(1)
NON_NEGATIVE = AtLeast(0)
