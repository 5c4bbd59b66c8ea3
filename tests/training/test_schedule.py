"""AsyncSchedule, VersionBuffer and the ring plan the simulator runs in-jit."""
import itertools

import numpy as np
import pytest

from lowrl.training.schedule import AsyncSchedule, VersionBuffer

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


@pytest.mark.parametrize("kwargs, match", [({"lag": -1}, "lag=-1: must be >= 0"),
                                           ({"sync_every": 0}, "sync_every=0: must be >= 1"),
                                           ({"lag_distribution": "poisson"}, "lag_distribution")])
def test_schedule_validation(kwargs, match):
  with pytest.raises(ValueError, match=match):
    AsyncSchedule(**kwargs)


# ---- FifoSchedule and LengthDrivenSchedule (same interface as AsyncSchedule).
from lowrl.training.schedule import FifoSchedule, LengthDrivenSchedule  # noqa: E402

FIFO_SCHEDULES = [FifoSchedule(lag=lag, sync_every=s, lag_distribution=d, seed=seed)
                  for lag, s, d, seed in itertools.product((0, 1, 2, 5), (1, 2, 3), DISTRIBUTIONS,
                                                           (0, 7))
                  if not (d != "fixed" and lag == 0)]
LENGTH_SCHEDULES = [LengthDrivenSchedule(tokens_per_step=tps, lengths=lengths, sync_every=s,
                                         seed=seed)
                    for tps, lengths, s, seed in itertools.product(
                        (0.6, 2.0, 10.0), ((1, 3, 6), (4, 4, 9, 20)), (1, 2), (0, 3))]


def _new_ids(s) -> str:
  if isinstance(s, LengthDrivenSchedule):
    return f"length-tps{s.tokens_per_step}-{len(s.lengths)}lens-sync{s.sync_every}-seed{s.seed}"
  return "fifo-" + _ids(s)


@pytest.mark.parametrize("s", FIFO_SCHEDULES, ids=_new_ids)
def test_fifo_never_goes_backwards_and_respects_its_bound(s):
  versions = [s.sampler_version(t) for t in range(STEPS)]
  for t, v in enumerate(versions):
    # Reference: the FIFO start of batch t is the running max over ALL earlier nominal starts.
    start = max(max(u - s.lag_at(u), 0) for u in range(t + 1))
    assert v == s.sync_every * (start // s.sync_every)
    assert v % s.sync_every == 0 and v <= t
    assert t - v <= s.lag + s.sync_every - 1
  assert all(b >= a for a, b in zip(versions, versions[1:]))


def test_independent_lags_go_backwards_and_fifo_does_not():
  """The issue's example: uniform lag 4 over 400 steps."""
  independent = AsyncSchedule(lag=4, lag_distribution="uniform")
  fifo = FifoSchedule(lag=4, lag_distribution="uniform")
  v_ind = np.array([independent.sampler_version(t) for t in range(400)])
  v_fifo = np.array([fifo.sampler_version(t) for t in range(400)])
  assert (np.diff(v_ind) < 0).sum() > 50  # 101 with numpy's PCG64 stream
  assert (np.diff(v_fifo) < 0).sum() == 0
  lags = np.arange(400) - v_fifo
  assert lags.max() == 4 and lags.min() == 0
  assert lags.mean() < (np.arange(400) - v_ind).mean()  # a FIFO is never staler than its draws


@pytest.mark.parametrize("lag, sync", [(0, 1), (3, 1), (4, 2)])
def test_fifo_with_a_fixed_lag_is_the_async_schedule(lag, sync):
  a, f = AsyncSchedule(lag=lag, sync_every=sync), FifoSchedule(lag=lag, sync_every=sync)
  assert ([a.sampler_version(t) for t in range(STEPS)]
          == [f.sampler_version(t) for t in range(STEPS)])
  assert a.max_versions == f.max_versions


@pytest.mark.parametrize("s", FIFO_SCHEDULES + LENGTH_SCHEDULES, ids=_new_ids)
def test_new_schedules_drive_the_version_buffer_and_the_ring(s):
  """The loop's put/get/evict sequence and the simulator's ring both serve sampler_version(t)."""
  buf = VersionBuffer(s)
  buf.put(0, "v0")
  for t in range(STEPS):
    v = s.sampler_version(t)
    assert v % s.sync_every == 0 and 0 <= v <= t
    assert buf.get(v) == f"v{v}"
    buf.put(t + 1, f"v{t + 1}")
    buf.evict_before(t + 1)
    assert len(buf) <= s.max_versions
  plan = s.ring_plan(STEPS)
  ring = [None] * s.max_versions
  for t in range(STEPS):
    if plan["write"][t]:
      ring[plan["write_slot"][t]] = t
    assert ring[plan["read_slot"][t]] == s.sampler_version(t) == plan["version"][t]


def test_length_driven_lag_is_the_generation_time_in_trainer_steps():
  # 0.6 tokens per trainer step: 1 token -> ceil(1.67) = 2, 3 -> 5, 6 -> 10 steps.
  s = LengthDrivenSchedule(tokens_per_step=0.6, lengths=(1, 3, 6))
  expected = {1: 2, 3: 5, 6: 10}
  assert s.lag == 10 and s.max_versions == 11
  for t in range(STEPS):
    assert s.lag_at(t) == expected[s.length_at(t)]
    assert s.sampler_version(t) == max(t - expected[s.length_at(t)], 0)
  # Faster than one token per step: every batch is one step stale (the pipelined minimum).
  fast = LengthDrivenSchedule(tokens_per_step=10.0, lengths=(1, 3, 6))
  assert {fast.lag_at(t) for t in range(STEPS)} == {1}
  lengths = np.array([s.length_at(t) for t in range(3000)])
  # Uniform over the 3 entries: binomial sd sqrt(2/9/3000) = 0.009, atol = 3.5 sd.
  np.testing.assert_allclose([np.mean(lengths == n) for n in (1, 3, 6)], [1 / 3] * 3, atol=0.03)


def test_longer_completions_are_staler():
  short = LengthDrivenSchedule(tokens_per_step=1.5, lengths=(2, 5, 9, 14), seed=4)
  long = LengthDrivenSchedule(tokens_per_step=1.5, lengths=(4, 10, 18, 28), seed=4)
  lags_short = np.array([short.lag_at(t) for t in range(STEPS)])
  lags_long = np.array([long.lag_at(t) for t in range(STEPS)])
  assert np.all(lags_long >= lags_short) and lags_long.mean() > lags_short.mean()
  # Within one schedule the lag is non-decreasing in the batch's length.
  order = np.argsort([short.length_at(t) for t in range(STEPS)], kind="stable")
  assert np.all(np.diff(lags_short[order]) >= 0)


@pytest.mark.parametrize("kwargs, match", [
    ({"lengths": ()}, "lengths must be positive ints"),
    ({"lengths": (3, 0)}, "lengths must be positive ints"),
    ({"tokens_per_step": 0.0}, "tokens_per_step must be > 0"),
    ({"lag_distribution": "uniform"}, "leave lag_distribution='fixed'"),
    ({"lag": 7}, "derives lag=2 from `lengths`; leave lag=0"),
    ({"sync_every": 0}, "sync_every=0: must be >= 1")])
def test_length_driven_validation(kwargs, match):
  with pytest.raises(ValueError, match=match):
    LengthDrivenSchedule(**{"tokens_per_step": 1.0, "lengths": (2,), **kwargs})


def test_fifo_validation():
  with pytest.raises(ValueError, match="lag=-1: must be >= 0"):
    FifoSchedule(lag=-1)


@pytest.mark.parametrize("lag, sync_every, horizon", [(0, 1, 4), (2, 1, 4), (3, 2, 6), (8, 1, 6)])
def test_pipeline_token_versions(lag, sync_every, horizon):
  """PipelineRL: token j of step t's batch is generated during step t - lag + floor(j lag / H)
  with the version synced last by then; tokens within a sequence and steps never go backwards."""
  from lowrl.training.schedule import PipelineSchedule
  s = PipelineSchedule(lag=lag, sync_every=sync_every)
  steps = 20
  plan = s.token_ring_plan(steps, horizon)
  version = plan["token_version"]
  for t in range(steps):
    for j in range(horizon):
      during = max(t - lag + (j * lag) // horizon, 0)  # the spec, token by token
      assert version[t, j] == sync_every * (during // sync_every)
    assert version[t, 0] == s.sampler_version(t) == plan["version"][t]
    if lag == 0:
      assert list(version[t]) == [t - t % sync_every] * horizon
  assert np.all(np.diff(version, axis=1) >= 0) and np.all(np.diff(version, axis=0) >= 0)
  assert np.all(version <= np.arange(steps)[:, None])
  if lag >= 2 and sync_every == 1:  # one sequence spans several versions
    assert len(set(version[-1])) > 1
  # Every token's version is in the ring slot the plan says, as the version buffer holds it.
  assert np.array_equal(plan["token_read_slot"], (version // sync_every) % s.max_versions)
  with pytest.raises(ValueError, match="pipeline depth"):
    PipelineSchedule(lag=2, lag_distribution="uniform")
