"""The simulated system's clock: a simulator setting -> the real RL system it stands for, priced by
the cost model (lowrl.asyncrl.cost_model).

The simulator trains a tiny decoder on a toy task; its clock is that of a modelled system
(`cost` section of the simulator's config): a real model (`MODEL_SIZES`) on `hardware`, with
sampler_devices + trainer_devices, where one simulated sequence stands for
`sequences_per_sim_sequence` real ones (B = num_prompts · group_size · that) and one simulated
completion token for `tokens_per_sim_token` real ones (H = task.length · that), each side in its
simulated precision recipe (`cost_model.precision_of`). So batch, horizon, recipe and device split
all move the lag and the step time, as they do in a real system.

  lag="auto"   the steady state's lag (`CostModel.steady_state().lag`, >= 1);
  step time    the steady state's step (samplers and trainer overlap) when the lag is >= 1, the
               synchronous step (sample, sync, train in turn on all the devices) at lag 0;
  GPU-hours    (sampler_devices + trainer_devices) · step time / 3600 per step.
An explicit lag overrides the model's (the step time stays the model's).
"""
from __future__ import annotations

import dataclasses

import ml_collections

from lowrl import hardware as hardware_lib
from lowrl import precision
from lowrl.asyncrl.cost_model import Cluster, CostModel, ModelSize, Workload, precision_of

# Published sizes (config.json of each checkpoint): decoder blocks' linears + LM head.
MODEL_SIZES = {
    # Llama-3.1-8B: D 4096, 32 layers, 32 q / 8 kv heads of 128, F 14336, V 128256, untied.
    "llama3.1_8b": ModelSize(
        n_params=32 * (2 * 4096 * 4096 + 2 * 4096 * 1024 + 3 * 4096 * 14336) + 4096 * 128256
        + 32 * 2 * 4096 + 4096,
        n_quantizable=32 * (2 * 4096 * 4096 + 2 * 4096 * 1024 + 3 * 4096 * 14336),
        n_layers=32, q_dim=4096, kv_dim=1024),
    # Qwen2.5-1.5B: D 1536, 28 layers, 12 q / 2 kv heads of 128, F 8960, V 151936, tied.
    "qwen2.5_1.5b": ModelSize(
        n_params=28 * (2 * 1536 * 1536 + 2 * 1536 * 256 + 3 * 1536 * 8960) + 1536 * 151936
        + 28 * 2 * 1536 + 1536,
        n_quantizable=28 * (2 * 1536 * 1536 + 2 * 1536 * 256 + 3 * 1536 * 8960),
        n_layers=28, q_dim=1536, kv_dim=256),
}


@dataclasses.dataclass(frozen=True)
class Clock:
  """What one simulated trainer step costs in the modelled system."""

  lag: int                   # the model's steady-state lag (>= 1)
  step_s: float              # pipelined step (lag >= 1)
  synchronous_step_s: float  # no overlap (lag 0)
  devices: int
  decode_tokens_per_step: float  # real tokens one sequence decodes per pipelined trainer step

  def step_at(self, lag: int) -> float:
    """Seconds per trainer step when the run's lag is `lag` (0 = synchronous)."""
    return self.synchronous_step_s if lag == 0 else self.step_s

  def gpu_hours_at(self, lag: int) -> float:
    """GPU-hours per trainer step at lag `lag`."""
    return self.devices * self.step_at(lag) / 3600.0


def recipe_config(name: str, overrides: ml_collections.ConfigDict | dict) -> ml_collections.ConfigDict:
  """The named precision recipe with the simulator's component overrides (None = the recipe's own)
  applied where the recipe quantizes (a BF16/FP32 recipe has no components)."""
  c = precision.recipe(name)
  if c.format == precision.FORMAT_NONE:
    return c
  for k, v in dict(overrides).items():
    if v is not None:
      c[k] = v
  return c


def cost_model(cfg: ml_collections.ConfigDict) -> CostModel:
  """The CostModel of a (validated) simulator setting's modelled system."""
  c = cfg.cost
  model = MODEL_SIZES[c.model]
  workload = Workload(
      batch=cfg.rl.num_prompts * cfg.rl.group_size * c.sequences_per_sim_sequence,
      prompt_len=c.prompt_len, horizon=cfg.task.length * c.tokens_per_sim_token,
      epochs=cfg.rl.mu, recompute_old_logp=cfg.rl.old_logp_source == "trainer",
      sync_every=cfg.async_rl.sync_every)
  cluster = Cluster(hardware_lib.hardware(c.hardware), sampler_devices=c.sampler_devices,
                    trainer_devices=c.trainer_devices, sampler_tp=c.sampler_tp, mfu=c.mfu,
                    max_in_flight=c.max_in_flight)
  sampler, trainer = (precision_of(recipe_config(name, cfg.recipe), model.n_layers)
                      for name in (cfg.sampler_recipe, cfg.trainer_recipe))
  return CostModel(model, workload, cluster, sampler, trainer)


def clock(cfg: ml_collections.ConfigDict) -> Clock:
  """The setting's Clock (raises ValueError naming the knob when the modelled system does not fit)."""
  model = cost_model(cfg)
  try:
    ss = model.steady_state()
  except ValueError as e:
    raise ValueError(f"--config.cost: {e}") from None
  decode_step_s = (ss.generate_s - ss.prefill_s) / max(model.workload.horizon - 1, 1)
  return Clock(lag=ss.lag, step_s=ss.step_s, synchronous_step_s=ss.synchronous_step_s,
               devices=model.cluster.sampler_devices + model.cluster.trainer_devices,
               decode_tokens_per_step=ss.step_s / decode_step_s)
