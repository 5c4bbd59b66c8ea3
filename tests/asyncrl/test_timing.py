"""The simulator's clock (lowrl.asyncrl.timing): a setting -> the modelled system's cost model."""
import pytest

from lowrl.asyncrl import simulator, timing
from lowrl.asyncrl.cost_model import Precision, Workload


def _setting(**cost):
  """A simulator setting with every number the tests compute by hand given explicitly (the
  defaults may change)."""
  c = simulator.default_config()
  c.sampler_recipe, c.trainer_recipe = "nvfp4_recipe", "bf16"
  c.rl.update(num_prompts=8, group_size=8, mu=1, old_logp_source="trainer")
  c.async_rl.sync_every = 1
  c.task.length = 6
  c.cost.update(hardware="h100_sxm", model="llama3.1_8b", sampler_devices=8, trainer_devices=8,
                sampler_tp=1, mfu=0.4, max_in_flight=None, prompt_len=256,
                tokens_per_sim_token=256, sequences_per_sim_sequence=4)
  c.cost.update(**cost)
  return c


def test_the_modelled_system_is_the_setting_scaled_by_hand():
  model = timing.cost_model(_setting())
  # 8 x 8 simulated sequences x 4 = 256 real ones; 6 simulated completion tokens x 256 = 1536.
  assert model.workload == Workload(batch=256, prompt_len=256, horizon=1536, epochs=1,
                                    recompute_old_logp=True, sync_every=1)
  # Llama-3.1-8B's published parameter count (8,030,261,248: its safetensors index) is the
  # matmul weights the cost model reads plus the input embedding [128256, 4096], a gather.
  assert model.model.n_params + 128256 * 4096 == 8_030_261_248
  assert (model.cluster.sampler_devices, model.cluster.trainer_devices) == (8, 8)
  assert model.cluster.hardware.bf16_tflops == 989.5  # H100 SXM dense BF16 (datasheet / 2)
  # nvfp4_recipe keeps round(0.15 x 32) = 5 of the 32 layers in BF16; the BF16 trainer has none.
  assert model.sampler == Precision("nvfp4", 5 / 32, "bf16") and model.trainer == Precision()


def test_a_trainer_bound_step_is_the_train_step_computed_by_hand():
  # One trainer device against 64 samplers: the trainer is the bottleneck, so the pipelined step
  # is the BF16 train step of the cost model's formula (cost_model docstring), by hand:
  # F = 2 N T + 2 L q T (T + 1) per sequence of T = P + H tokens; forward + backward (3F) + the
  # pi_old recompute (F), over B sequences, at the BF16 rate times mfu.
  c = _setting(sampler_devices=64, trainer_devices=1)
  n, layers, q = timing.MODEL_SIZES["llama3.1_8b"].n_params, 32, 4096
  t = 256 + 1536
  flops = 256 * 4 * (2 * n * t + 2 * layers * q * t * (t + 1))
  train_s = flops / (989.5e12 * 0.4)
  clock = timing.clock(c)
  assert clock.step_s == pytest.approx(train_s, rel=1e-9)
  assert clock.step_at(3) == clock.step_s
  assert clock.gpu_hours_at(3) == pytest.approx(65 * train_s / 3600, rel=1e-9)


@pytest.mark.parametrize("cost", [{}, dict(sampler_devices=2, trainer_devices=14),
                                  dict(sampler_devices=64, trainer_devices=1),
                                  dict(max_in_flight=1), dict(hardware="b200")])
def test_overlap_never_makes_a_step_slower_than_running_in_turn(cost):
  """Pipelined step = max(train, G(k)/k + sync/sync_every) <= G(1) + sync + train, the
  synchronous step (G(k)/k is non-increasing in k): an invariant, whatever the numbers."""
  clock = timing.clock(_setting(**cost))
  devices = 16 if not cost.get("trainer_devices") else cost["sampler_devices"] + cost[
      "trainer_devices"]
  assert clock.lag >= 1 and isinstance(clock.lag, int)
  assert 0 < clock.step_s <= clock.synchronous_step_s
  assert clock.step_at(0) == clock.synchronous_step_s
  assert clock.gpu_hours_at(0) == pytest.approx(devices * clock.synchronous_step_s / 3600)


def test_auto_lag_and_schedule_use_the_clock():
  c = _setting()
  c.async_rl.lag = "auto"
  lag = timing.clock(c).lag
  assert simulator.lag_of(c) == lag and simulator.schedule_of(c).lag == lag


def test_batch_horizon_and_devices_move_the_auto_lag():
  c = simulator.default_config()
  c.async_rl.lag = "auto"
  base = timing.clock(c)
  c.task.length = 24  # 4x the horizon: a batch takes longer to generate than a train step grows
  longer = timing.clock(c)
  assert longer.lag >= base.lag and longer.step_s > base.step_s
  c.cost.update(sampler_devices=4)
  fewer = timing.clock(c)
  assert fewer.step_s >= longer.step_s  # half the samplers are never faster


def test_length_schedule_and_recipe_components():
  c = simulator.default_config()
  c.async_rl.update(schedule="length", lag="auto", lengths=(512, 4096))
  s = simulator.schedule_of(c)
  tps = timing.clock(c).decode_tokens_per_step
  assert s.lengths == (512, 4096) and s.tokens_per_step == tps
  assert s.lag == max(1, -(-4096 // int(tps)) if tps == int(tps) else int(4096 // tps) + 1)
  c.async_rl.lag = 3
  with pytest.raises(ValueError, match="schedule=length"):
    simulator.build(c)
  c = simulator.default_config()
  c.sampler_recipe = "nvfp4_recipe"
  c.recipe.update(four_over_six=False, act_per_token=False)
  cfg = timing.recipe_config("nvfp4_recipe", c.recipe)
  assert not cfg.four_over_six and not cfg.act_per_token and cfg.bf16_last_fraction == 0.15
  assert timing.recipe_config("bf16", c.recipe).four_over_six is False  # BF16 has no components
  c.async_rl.lag = "soon"
  with pytest.raises(ValueError, match="async_rl.lag"):
    simulator.build(c)
