"""AsyncSchedule, VersionBuffer and the ring plan the simulator runs in-jit."""
import itertools

import numpy as np
import pytest

from lowrl.asyncrl.schedule import AsyncSchedule, VersionBuffer

STEPS = 40
DISTRIBUTIONS = ("fixed", "uniform", "geometric")
SCHEDULES = [AsyncSchedule(lag=lag, sync_every=s, lag_distribution=d, seed=seed)
             for lag, s, d, seed in itertools.product((0, 1, 2, 5), (1, 2, 3), DISTRIBUTIONS, (0, 7))
             if not (d != "fixed" and lag == 0)]


def _ids(s: AsyncSchedule) -> str:
  return f"lag{s.lag}-sync{s.sync_every}-{s.lag_distribution}-seed{s.seed}"


def test_synchronous_schedule_samples_with_current_params():
  s = AsyncSchedule()
  assert [s.sampler_version(t) for t in range(STEPS)] == list(range(STEPS))
  assert s.max_versions == 1


@pytest.mark.parametrize("s", SCHEDULES, ids=_ids)
def test_sampler_version_is_a_synced_past_version_within_the_lag(s):
  for t in range(STEPS):
    v = s.sampler_version(t)
    assert v % s.sync_every == 0
    assert max(t - s.lag, 0) - s.sync_every < v <= t
    assert t - v <= s.lag + s.sync_every - 1


def test_lag_draws_follow_the_distribution_and_replay():
  uniform = AsyncSchedule(lag=3, lag_distribution="uniform", seed=1)
  geometric = AsyncSchedule(lag=3, lag_distribution="geometric", seed=1)
  lags_u = np.array([uniform.lag_at(t) for t in range(4000)])
  lags_g = np.array([geometric.lag_at(t) for t in range(4000)])
  np.testing.assert_allclose(np.bincount(lags_u, minlength=4) / 4000, [0.25] * 4, atol=0.03)
  np.testing.assert_allclose(np.bincount(lags_g, minlength=4) / 4000,
                             np.array([8, 4, 2, 1]) / 15, atol=0.03)
  assert [uniform.lag_at(t) for t in range(50)] == list(lags_u[:50])  # replayable
  other = AsyncSchedule(lag=3, lag_distribution="uniform", seed=2)
  assert [other.lag_at(t) for t in range(50)] != list(lags_u[:50])


@pytest.mark.parametrize("s", SCHEDULES, ids=_ids)
def test_version_buffer_holds_what_is_needed_and_no_more(s):
  """Replays the loop's put/get/evict sequence over a run."""
  buf = VersionBuffer(s)
  buf.put(0, "v0")
  sizes = []
  for t in range(STEPS):
    v = s.sampler_version(t)
    assert buf.get(v) == f"v{v}"
    buf.put(t + 1, f"v{t + 1}")
    buf.evict_before(t + 1)
    sizes.append(len(buf))
    # Every held version is synced and still reachable by some later batch.
    for held in buf.versions():
      assert held % s.sync_every == 0 and held <= t + 1
      assert held >= max(t + 1 - s.lag, 0) - s.sync_every + 1
    if s.lag_distribution == "fixed":
      # Exactly the versions some step >= t + 1 samples with (among those synced so far).
      future = {s.sampler_version(u) for u in range(t + 1, t + 2 + s.lag + s.sync_every)}
      synced = set(range(0, t + 2, s.sync_every))
      assert set(buf.versions()) == future & synced
  assert max(sizes) == s.max_versions or s.lag_distribution != "fixed"
  assert max(sizes) <= s.max_versions


def test_version_buffer_refuses_an_evicted_version():
  s = AsyncSchedule(lag=1)
  buf = VersionBuffer(s)
  for v in range(4):
    buf.put(v, v)
  buf.evict_before(3)
  assert buf.versions() == [2, 3]
  with pytest.raises(KeyError, match="version 1 was not kept"):
    buf.get(1)


@pytest.mark.parametrize("s", SCHEDULES, ids=_ids)
@pytest.mark.parametrize("extra_slots", [0, 3])
def test_ring_plan_replays_the_version_buffer(s, extra_slots):
  """A ring driven by the plan reads, at every step, exactly sampler_version(t)."""
  slots = s.max_versions + extra_slots
  plan = s.ring_plan(STEPS, slots)
  ring = [None] * slots
  for t in range(STEPS):
    if plan["write"][t]:
      ring[plan["write_slot"][t]] = t
    assert ring[plan["read_slot"][t]] == s.sampler_version(t) == plan["version"][t]


def test_ring_plan_rejects_a_too_small_ring():
  s = AsyncSchedule(lag=4, sync_every=2)
  assert s.max_versions == 3
  with pytest.raises(ValueError, match="3 versions"):
    s.ring_plan(10, 2)


@pytest.mark.parametrize("kwargs, match", [({"lag": -1}, "lag must be >= 0"),
                                           ({"sync_every": 0}, "sync_every must be >= 1"),
                                           ({"lag_distribution": "poisson"}, "lag_distribution")])
def test_schedule_validation(kwargs, match):
  with pytest.raises(ValueError, match=match):
    AsyncSchedule(**kwargs)
