"""The loop's memory check (`lowrl.training.setup.build`): the per-device estimate is printed, and a config that
cannot fit is refused before anything is compiled, naming the flag to change."""

import jax
import jax.monitoring
import pytest

from configs import base
from lowrl import memory
from lowrl.models import init, transformer
from lowrl.training import loop, run_config, schema
from lowrl.training.setup import build
from lowrl.training.reporting import log_setup


def _cfg(**rl):
  cfg = base.get_config("bf16")
  cfg.sft.steps = 0
  for k, v in rl.items():
    cfg.rl[k] = v
  return cfg


class _Compiles:
  """Counts XLA backend compiles while active (jax.monitoring's compile-duration events)."""

  def __enter__(self):
    self.count = 0
    self._listener = lambda name, *_, **__: setattr(
        self, "count", self.count + (name == "/jax/core/compile/backend_compile_duration"))
    jax.monitoring.register_event_duration_secs_listener(self._listener)
    return self

  def __exit__(self, *exc):
    jax.monitoring.unregister_event_duration_listener(self._listener)


def test_a_config_that_cannot_fit_is_refused_before_any_compile(tmp_path):
  # A 1.9B-parameter decoder and 32768 rows per step: on 8 devices each holds 4096 sequences'
  # block activations (~100 GB in BF16), more than 0.9 x 80 GB.
  cfg = _cfg(num_prompts=4096)
  cfg.model.update(d_model=4096, n_layers=8, n_heads=32, n_kv_heads=8, head_dim=128,
                   d_ff=16384)
  cfg.hardware = "h100_sxm"
  with _Compiles() as compiles, pytest.raises(run_config.ConfigError) as e:
    loop.run(cfg, str(tmp_path / "run"))
  msg = str(e.value)
  assert msg.startswith("--config.hardware=h100_sxm (h100_sxm HBM): per-device memory estimate")
  assert "activations: blocks" in msg and "--config.model.remat=full" in msg
  assert "\n" not in msg
  assert compiles.count == 0
  assert not (tmp_path / "run").exists()  # refused before the workdir is touched
  # The same config with remat and more minibatches fits; hardware=none: no check.
  cfg.model.remat, cfg.rl.num_minibatches = "full", 64
  build(cfg)
  cfg.model.remat, cfg.rl.num_minibatches = "none", 1
  cfg.hardware = "none"
  assert build(cfg).device_memory[0] is None


def test_on_cpu_the_estimate_is_checked_against_the_hosts_ram(tmp_path):
  # The tiny model with 100,000-token completions: a KV cache and activations of thousands of GB,
  # refused in one line before the base is trained or anything compiled (hardware=auto, the
  # default, is the host's RAM on CPU).
  cfg = _cfg(max_new_tokens=100_000)
  cfg.sft.steps = 5
  assert cfg.hardware == memory.AUTO
  with _Compiles() as compiles, pytest.raises(run_config.ConfigError) as e:
    loop.run(cfg, str(tmp_path / "run"))
  msg = str(e.value)
  assert msg.startswith("--config.hardware=auto (") and "of host RAM" in msg, msg
  assert "\n" not in msg and compiles.count == 0
  assert not (tmp_path / "run").exists()


def test_the_estimate_is_the_runs_and_is_printed():
  cfg = _cfg(mu=2, num_minibatches=2)
  cfg.async_rl.lag = 1
  cfg.hardware = "h100_sxm"
  setup = build(cfg)
  est = setup.memory
  # The loop's state: params and Adam over the master tree, a reference, one stale version copy,
  # the RL sampler's KV cache (all rows, every device along `data`).
  shapes = init.param_shapes(setup.model_cfg)
  n_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(shapes))
  devices = jax.device_count()
  assert est.params == -(-n_bytes // devices)
  assert est.grads == est.params  # minibatches accumulate nothing
  assert est.optimizer == 2 * est.params and est.reference == est.params
  assert est.async_versions == setup.schedule.max_versions * est.params
  rows = cfg.rl.num_prompts * cfg.rl.group_size
  seq_len = setup.task.max_prompt_len + cfg.rl.max_new_tokens
  cache = jax.eval_shape(lambda: transformer.init_cache(
      setup.model_cfg, rows // devices, seq_len, setup.sampler_policy.dtype))
  assert est.kv_cache == sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(cache))
  assert dict(est.settings)["micro_batch"] == rows // 2
  lines = []
  log_setup(setup, "/tmp/unused", lines.append)
  text = "\n".join(lines)
  assert "[memory] per-device estimate before compiling" in text
  assert "of 80.0 GB; h100_sxm HBM" in text
  for word in ("params", "KV cache", "attention scores", "total", "expected step"):
    assert word in text


def test_hardware_knob_is_checked():
  cfg = _cfg()
  cfg.hardware = "a100"
  with pytest.raises(ValueError, match="--config.hardware='a100': use one of 'auto', 'none'"):
    build(cfg)
  # Every value the error offers is one the schema and the memory check accept; "none" turns the
  # fit check off.
  for choice in memory.HARDWARE_CHOICES:
    cfg.hardware = choice
    schema.TRAIN.validate(cfg)
    memory.device_memory(choice)
  assert memory.device_memory("none")[0] is None
  assert "hardware" in run_config.COSMETIC_KEYS  # the budget changes no result
