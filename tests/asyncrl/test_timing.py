"""The simulator's clock (lowrl.asyncrl.timing): a setting -> the modelled system's cost model."""
import pytest

from lowrl import hardware
from lowrl.asyncrl import simulator, timing
from lowrl.asyncrl.cost_model import Cluster, CostModel, Precision, Workload


def test_clock_is_the_cost_model_of_the_modelled_system():
  c = simulator.default_config()
  c.sampler_recipe, c.trainer_recipe = "nvfp4_recipe", "bf16"
  c.rl.update(num_prompts=8, group_size=8)
  c.task.length = 6
  c.cost.update(sampler_devices=8, trainer_devices=8, prompt_len=256, tokens_per_sim_token=256,
                sequences_per_sim_sequence=4)
  model = timing.cost_model(c)
  # By hand: 8 x 8 x 4 sequences of 256 prompt + 6 x 256 completion tokens, Llama-3.1-8B sizes.
  assert model.workload == Workload(batch=256, prompt_len=256, horizon=1536, epochs=1,
                                    recompute_old_logp=True, sync_every=1)
  assert model.model.n_params == 32 * (2 * 4096 ** 2 + 2 * 4096 * 1024 + 3 * 4096 * 14336) \
      + 4096 * 128256 + 32 * 2 * 4096 + 4096
  assert model.cluster == Cluster(hardware.HARDWARE["h100_sxm"], 8, 8)
  # nvfp4_recipe keeps round(0.15 x 32) = 5 of the 32 layers in BF16; the BF16 trainer has none.
  assert model.sampler == Precision("nvfp4", 5 / 32, "bf16") and model.trainer == Precision()
  ss = CostModel(model.model, model.workload, model.cluster, model.sampler,
                 model.trainer).steady_state()
  clock = timing.clock(c)
  assert (clock.lag, clock.step_s, clock.synchronous_step_s) == (ss.lag, ss.step_s,
                                                                 ss.synchronous_step_s)
  assert clock.step_at(0) == ss.synchronous_step_s and clock.step_at(3) == ss.step_s
  assert clock.gpu_hours_at(2) == pytest.approx(16 * ss.step_s / 3600)
  c.async_rl.lag = "auto"
  assert simulator.lag_of(c) == ss.lag
  assert simulator.schedule_of(c).lag == ss.lag


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
