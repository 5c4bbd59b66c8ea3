"""Which policy version samples the batch that trainer step t consumes.

Version v is the parameter tree after v optimizer updates (v = 0 is the initial policy). In an
asynchronous system the samplers refresh their weights only every `sync_every` trainer steps, and the
batch the trainer consumes at step t was generated `lag` steps earlier. The version that sampled it is

    sampler_version(t) = sync_every * floor(max(t - lag_t, 0) / sync_every)

With lag 0 and sync every step this is t: the synchronous, on-policy trainer.

`AsyncSchedule` draws lag_t independently each step, so the consumed version can go backwards.
Two more realistic schedules share its interface (`sampler_version`, `oldest_needed`,
`max_versions`, `ring_plan`): `FifoSchedule` (bounded-staleness FIFO: versions never go backwards),
`PipelineSchedule` (PipelineRL's in-flight weight updates: one sequence's tokens come from several
versions) and `LengthDrivenSchedule` (a batch's lag follows its longest completion's generation
time).
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any

import numpy as np

LAG_DISTRIBUTIONS = ("fixed", "uniform", "geometric")


@dataclasses.dataclass(frozen=True)
class AsyncSchedule:
  """Staleness knobs.

  Attributes:
    lag: off-policy lag in trainer steps (the maximum lag for random distributions).
    sync_every: samplers refresh their weights every `sync_every` trainer steps (>= 1).
    lag_distribution: "fixed" (always `lag`), "uniform" (uniform on 0..lag) or "geometric"
      (P(l) ∝ 0.5^l on 0..lag).
    seed: seeds the lag draws, so a run can be replayed.
  """

  lag: int = 0
  sync_every: int = 1
  lag_distribution: str = "fixed"
  seed: int = 0

  def __post_init__(self):
    # Messages start with the field name: callers prefix their config path (async_rl.lag=...).
    if self.lag < 0:
      raise ValueError(f"lag={self.lag}: must be >= 0 trainer steps (0 = synchronous).")
    if self.sync_every < 1:
      raise ValueError(f"sync_every={self.sync_every}: must be >= 1 trainer step.")
    if self.lag_distribution not in LAG_DISTRIBUTIONS:
      raise ValueError(
          f"lag_distribution={self.lag_distribution!r}; use one of {LAG_DISTRIBUTIONS}.")

  def lag_at(self, step: int) -> int:
    """The lag of the batch consumed at trainer step `step` (deterministic in seed and step)."""
    if self.lag_distribution == "fixed" or self.lag == 0:
      return self.lag
    rng = np.random.default_rng([self.seed, step])
    support = np.arange(self.lag + 1)
    if self.lag_distribution == "uniform":
      return int(rng.integers(0, self.lag + 1))
    probs = 0.5 ** support
    return int(rng.choice(support, p=probs / probs.sum()))

  def sampler_version(self, step: int) -> int:
    """Parameter version the samplers held when they generated step `step`'s batch."""
    produced_at = max(step - self.lag_at(step), 0)
    return self.sync_every * (produced_at // self.sync_every)

  def oldest_needed(self, step: int) -> int:
    """No batch consumed at `step` or later is sampled by a version older than this."""
    return self.sync_every * (max(step - self.lag, 0) // self.sync_every)

  @property
  def stale(self) -> bool:
    """Whether a sampler can hold an older version than the trainer's (a lag, or syncs less
    often than every step): the loop then copies versions and re-scores stale ones."""
    return self.lag > 0 or self.sync_every > 1

  @property
  def max_versions(self) -> int:
    """Most versions a VersionBuffer holds at once: ceil(lag / sync_every) + 1.

    After put(t) and evict_before(t) it holds the synced versions in [oldest_needed(t), t]; between
    sync_every * floor((t - lag) / sync_every) and sync_every * floor(t / sync_every) there are at
    most ceil(lag / sync_every) + 1 multiples of sync_every.
    """
    return -(-self.lag // self.sync_every) + 1

  def ring_plan(self, steps: int, num_slots: int | None = None) -> dict[str, np.ndarray]:
    """The VersionBuffer of steps 0..steps-1 as a ring of `num_slots` parameter slots (for jit).

    Synced version v lives in slot (v // sync_every) % num_slots, so a ring of at least
    `max_versions` slots never overwrites a version a later step still samples with.

    Returns int32/bool arrays [steps]: `write` (version t = params after t updates is synced
    before step t samples), `write_slot`, `read_slot` (slot of the sampler's version) and
    `version` (= sampler_version(t), what the read slot must hold).
    """
    num_slots = self.max_versions if num_slots is None else num_slots
    if num_slots < self.max_versions:
      raise ValueError(f"a ring of {num_slots} parameter slots cannot hold the "
                       f"{self.max_versions} versions lag={self.lag}, "
                       f"sync_every={self.sync_every} needs.")
    t = np.arange(steps)
    version = np.array([self.sampler_version(int(i)) for i in t], np.int32)
    return {"write": t % self.sync_every == 0,
            "write_slot": ((t // self.sync_every) % num_slots).astype(np.int32),
            "read_slot": ((version // self.sync_every) % num_slots).astype(np.int32),
            "version": version}


class VersionBuffer:
  """Keeps exactly the parameter versions the schedule may still ask for."""

  def __init__(self, schedule: AsyncSchedule):
    self.schedule = schedule
    self._versions: dict[int, Any] = {}

  def __len__(self) -> int:
    return len(self._versions)

  def versions(self) -> list[int]:
    return sorted(self._versions)

  def put(self, version: int, params: Any) -> None:
    """Records the params after `version` updates if a future batch may be sampled by them."""
    if version % self.schedule.sync_every == 0:
      self._versions[version] = params

  def get(self, version: int) -> Any:
    if version not in self._versions:
      raise KeyError(f"parameter version {version} was not kept; kept: {self.versions()}.")
    return self._versions[version]

  def evict_before(self, step: int) -> None:
    """Drops versions no batch at `step` or later can need."""
    oldest = self.schedule.oldest_needed(step)
    for v in [v for v in self._versions if v < oldest]:
      del self._versions[v]


@dataclasses.dataclass(frozen=True)
class FifoSchedule(AsyncSchedule):
  """Bounded-staleness FIFO (prime-rl's async level, AReaL's max staleness): batches are consumed
  in the order they were generated, so the consumed version never goes backwards.

  Batch t's nominal start is t - lag_at(t) (the AsyncSchedule draw: `lag` is the bound, the
  distribution the jitter of generation times); in a FIFO it cannot start before batch t-1, so

      sampler_version(t) = sync_every * floor(max_{u <= t} max(u - lag_at(u), 0) / sync_every)

  which is non-decreasing in t and within `lag` (+ sync_every - 1) of t. Only u in [t - lag, t]
  can attain the running max (u - lag_at(u) <= u < t - lag <= t - lag_at(t) otherwise). A fixed
  lag gives exactly AsyncSchedule's versions.
  """

  def sampler_version(self, step: int) -> int:
    produced_at = max(max(u - self.lag_at(u), 0) for u in range(max(step - self.lag, 0), step + 1))
    return self.sync_every * (produced_at // self.sync_every)

  def oldest_needed(self, step: int) -> int:
    """Versions never go backwards: no batch at `step` or later needs one older than step's."""
    return self.sampler_version(step)


@dataclasses.dataclass(frozen=True)
class LengthDrivenSchedule(AsyncSchedule):
  """Generation length drives staleness: a batch whose longest completion has n tokens took
  n / tokens_per_step trainer steps to generate, so it is consumed

      lag_at(t) = ceil(n_t / tokens_per_step)   (>= 1: the pipelined one-step-off minimum)

  updates after the version that sampled it (batches are consumed as they complete, so a long
  batch after a short one brings an older version back). n_t is drawn (seeded by seed and t) from
  `lengths`, an empirical distribution of per-batch longest completions, e.g. a base model's
  rollouts. tokens_per_step = decode tokens per trainer step (CostModel: train step / decode step).
  `lag` is derived (the longest length's lag, what the version buffer must cover); leave it 0.
  """

  tokens_per_step: float = 1.0
  lengths: tuple[int, ...] = (1,)

  def __post_init__(self):
    lengths = tuple(self.lengths)
    if not lengths or any(not isinstance(n, (int, np.integer)) or n < 1 for n in lengths):
      raise ValueError(f"LengthDrivenSchedule.lengths must be positive ints, got {self.lengths!r}.")
    if not self.tokens_per_step > 0:
      raise ValueError("LengthDrivenSchedule.tokens_per_step must be > 0, "
                       f"got {self.tokens_per_step}.")
    if self.lag_distribution != "fixed":
      raise ValueError("LengthDrivenSchedule draws its lags from `lengths`; leave "
                       "lag_distribution='fixed'.")
    object.__setattr__(self, "lengths", tuple(int(n) for n in lengths))
    derived = self._lag_of(max(lengths))
    if self.lag not in (0, derived):  # 0: not given; derived: a copy (dataclasses.replace)
      raise ValueError(f"LengthDrivenSchedule derives lag={derived} from `lengths`; leave lag=0, "
                       f"got lag={self.lag}.")
    object.__setattr__(self, "lag", derived)
    super().__post_init__()

  def _lag_of(self, length: int) -> int:
    # The 1e-9 keeps a float quotient that should be an integer (6 / 0.6) from rounding up.
    return max(1, math.ceil(length / self.tokens_per_step - 1e-9))

  def length_at(self, step: int) -> int:
    """The longest completion of the batch consumed at `step` (deterministic in seed and step)."""
    rng = np.random.default_rng([self.seed, step])
    return self.lengths[int(rng.integers(len(self.lengths)))]

  def lag_at(self, step: int) -> int:
    return self._lag_of(self.length_at(step))


@dataclasses.dataclass(frozen=True)
class PipelineSchedule(FifoSchedule):
  """In-flight weight updates (PipelineRL): the samplers pick up every sync mid-generation, so one
  sequence's tokens come from several versions, the later tokens from newer ones.

  The batch consumed at step t is generated over the `lag` trainer steps before it; its token j of
  H is generated during step t - lag + floor(j * lag / H), with the version synced last by then:

      token_version(t, j) = sync_every * floor(max(t - lag + floor(j * lag / H), 0) / sync_every)

  non-decreasing in j and in t, token 0's version is `sampler_version(t)` (the FIFO's), the last
  token's at most t - 1 when lag >= 1; lag 0 is the synchronous trainer. The lag is fixed (the
  pipeline's depth).
  """

  def __post_init__(self):
    if self.lag_distribution != "fixed":
      raise ValueError("PipelineSchedule's lag is the pipeline depth; leave "
                       "lag_distribution='fixed'.")
    super().__post_init__()

  def token_versions(self, step: int, horizon: int) -> np.ndarray:
    """[horizon] int32: the version that generated each completion token of step's batch."""
    j = np.arange(horizon)
    produced_at = np.maximum(step - self.lag + (j * self.lag) // horizon, 0)
    return (self.sync_every * (produced_at // self.sync_every)).astype(np.int32)

  def token_ring_plan(self, steps: int, horizon: int, num_slots: int | None = None
                      ) -> dict[str, np.ndarray]:
    """`ring_plan` plus [steps, horizon] `token_version` and `token_read_slot` (its ring slot)."""
    plan = self.ring_plan(steps, num_slots)
    num_slots = self.max_versions if num_slots is None else num_slots
    version = np.stack([self.token_versions(t, horizon) for t in range(steps)])
    plan["token_version"] = version
    plan["token_read_slot"] = ((version // self.sync_every) % num_slots).astype(np.int32)
    return plan
