"""`setup.build`: the config becomes typed, frozen pieces once; nothing after it holds the raw
config."""
import dataclasses

import ml_collections
import pytest

import tiny
from configs import base as base_config
from lowrl.training.setup import Setup, build


def _reachable(obj, seen=None):
  """Every object reachable from `obj` through dataclass fields, tuples, lists and dicts."""
  seen = set() if seen is None else seen
  if id(obj) in seen:
    return
  seen.add(id(obj))
  yield obj
  if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
    children = [getattr(obj, f.name) for f in dataclasses.fields(obj)]
  elif isinstance(obj, (tuple, list)):
    children = list(obj)
  elif isinstance(obj, dict):
    children = [*obj.keys(), *obj.values()]
  else:
    children = list(vars(obj).values()) if hasattr(obj, "__dict__") else []
  for child in children:
    yield from _reachable(child, seen)


def test_the_setup_holds_no_config_dict_and_is_frozen():
  setup = build(tiny.loop_config("nvfp4_recipe", "/nonexistent"))
  held = [type(o).__name__ for o in _reachable(setup)
          if isinstance(o, (ml_collections.ConfigDict, ml_collections.FrozenConfigDict))]
  assert not held, f"a Setup reaches {held}: stages after build would read the raw config"
  with pytest.raises(dataclasses.FrozenInstanceError):
    setup.loop = None  # type: ignore[misc]


def test_the_setup_does_not_follow_later_edits_of_the_config():
  cfg = tiny.loop_config("fp32", "/nonexistent")
  setup = build(cfg)
  before = (setup.loop, setup.base, setup.record.fingerprint, setup.record.text,
            dict(setup.record.hparams), setup.task.max_prompt_len)
  cfg.seed, cfg.rl.steps, cfg.sft.lr, cfg.task.kwargs.num_digits = 7, 99, 1.0, 3
  cfg.optimizer.master_dtype, cfg.log_every = "bfloat16", 5
  assert (setup.loop, setup.base, setup.record.fingerprint, setup.record.text,
          dict(setup.record.hparams), setup.task.max_prompt_len) == before
  rebuilt = build(cfg)  # the edits are the new config's
  assert (rebuilt.loop.seed, rebuilt.loop.steps, rebuilt.base.sft.lr,
          rebuilt.loop.master_dtype) == (7, 99, 1.0, "bfloat16")
  assert rebuilt.base.fingerprint != setup.base.fingerprint  # another base (seed, lr, task)


@pytest.mark.parametrize("kl_coef,log_kl_ref,kept", [(0.0, False, False), (0.1, False, True),
                                                     (0.0, True, True)])
def test_the_reference_is_kept_for_the_kl_penalty_or_its_log(kl_coef, log_kl_ref, kept):
  cfg = tiny.loop_config("fp32", "/nonexistent")
  cfg.rl.kl_coef, cfg.rl.log_kl_ref = kl_coef, log_kl_ref
  setup = build(cfg)
  assert isinstance(setup, Setup) and setup.loop.keep_reference is kept
  assert (setup.memory.reference > 0) is kept  # the memory estimate counts the same copy


def test_base_seed_follows_the_run_seed_unless_sft_seed_is_set():
  """sft.seed = -1 means "the run's seed": the base (init and SFT data) is seeded by cfg.seed and
  its fingerprint moves with it; a non-negative sft.seed pins the base across run seeds."""
  def base(run_seed, sft_seed):
    cfg = base_config.get_config("bf16")
    cfg.sft.steps = 0
    cfg.seed, cfg.sft.seed = run_seed, sft_seed
    return build(cfg).base

  follow_3, follow_4 = base(3, -1), base(4, -1)
  assert (follow_3.seed, follow_4.seed) == (3, 4)
  assert follow_3.fingerprint != follow_4.fingerprint
  pinned_3, pinned_4 = base(3, 7), base(4, 7)
  assert pinned_3.seed == pinned_4.seed == 7
  assert pinned_3.fingerprint == pinned_4.fingerprint
