"""The async-RL cost model against hand arithmetic from its formulas, plus monotonicity and errors.

Every expected value is written out from the formulas (module docstring of
lowrl.asyncrl.cost_model) with the published sizes of Llama-3.1-8B; float64 sums of a few hundred
terms agree to ~1e-13 relative, so rel=1e-9 is tight and platform independent. NVFP4 / MXFP8 bytes
per weight also carry one FP32 per-tensor scale per 4096x4096 reference kernel (4 / 4096^2 bytes,
< 3e-7 relative), hence rel=1e-6 where they enter.
"""
import dataclasses
import math

import pytest

from lowrl import precision
from lowrl.asyncrl.cost_model import (HARDWARE, Cluster, CostModel, Hardware, ModelSize, Precision,
                                      Workload, precision_of)
from lowrl.training.schedule import AsyncSchedule
from lowrl.models.config import ModelConfig

# Llama-3.1-8B: D 4096, 32 layers, 32 q heads, 8 kv heads of 128, F 14336, V 128256, untied.
LLAMA8B = ModelConfig(vocab_size=128256, d_model=4096, n_layers=32, n_heads=32, n_kv_heads=8,
                      head_dim=128, d_ff=14336)
BLOCKS = 32 * (4096 * 4096 * 2 + 4096 * 1024 * 2 + 3 * 4096 * 14336)  # q, o; k, v; gate, up, down
NORMS = 32 * 2 * 4096 + 4096
N = BLOCKS + 4096 * 128256 + NORMS     # blocks + LM head (the input embedding is a gather)
M8B = ModelSize(n_params=N, n_quantizable=BLOCKS, n_layers=32, q_dim=4096, kv_dim=1024)
KVT = 2 * 32 * 1024 * 2                # bytes of K and V per token, BF16
H100 = HARDWARE["h100_sxm"]
B200 = HARDWARE["b200"]
BW_H100 = 3.35e12 * 0.8                # HBM bytes/s at the default 80% efficiency
BF16_H100 = 989.5e12 * 0.4             # dense BF16 FLOP/s at the default 40% MFU


def _model(workload=Workload(batch=8, prompt_len=64, horizon=256), cluster=None,
           sampler=Precision(), trainer=Precision()) -> CostModel:
  cluster = cluster or Cluster(H100, sampler_devices=8, trainer_devices=8)
  return CostModel(M8B, workload, cluster, sampler, trainer)


def test_model_size_of_llama_8b():
  assert ModelSize.from_model_config(LLAMA8B) == M8B
  assert N + 4096 * 128256 == 8_030_261_248  # the published parameter count


def test_decode_step_of_an_8b_model_on_h100_is_bytes_over_bandwidth():
  cm = _model()
  for rows, context in [(1, 65), (1, 4096), (32, 2048)]:
    expected = (2 * N + rows * context * KVT) / BW_H100
    assert cm.decode_step_s(rows, context) == pytest.approx(expected, rel=1e-9)
    # ~6 ms per token for one sequence: 15 GB of BF16 weights over 2.68 TB/s.
  assert 5.5e-3 < cm.decode_step_s(1, 65) < 6.0e-3


def test_prefill_is_compute_bound():
  cm = _model(Workload(batch=64, prompt_len=512, horizon=16))
  rows, p = 64, 512
  flops = rows * (2 * N * p + 2 * 32 * 4096 * p * (p + 1))
  assert flops / BF16_H100 > (2 * N + rows * p * KVT) / BW_H100
  assert cm.prefill_s(rows) == pytest.approx(flops / BF16_H100, rel=1e-9)


def test_generation_of_one_sequence_sums_the_memory_bound_steps():
  # One sequence, P = 64, H = 256: prefill (64 tokens: memory-bound) + 255 decode steps.
  cm = _model()
  expected = (256 * 2 * N + KVT * (64 + sum(64 + j for j in range(1, 256)))) / BW_H100
  assert cm.generate_s(1) == pytest.approx(expected, rel=1e-9)


def test_nvfp4_weight_bytes_and_decode_on_b200():
  nvfp4 = Precision("nvfp4")
  assert nvfp4.bytes_per_weight == pytest.approx(0.5 + 1 / 16, rel=1e-6)  # 4.5 bits (E4M3 / 16)
  assert Precision("mxfp8_e4m3").bytes_per_weight == pytest.approx(1 + 1 / 32, rel=1e-6)
  cm = _model(cluster=Cluster(B200, 8, 8), sampler=nvfp4)
  w = BLOCKS * 0.5625 + (N - BLOCKS) * 2
  assert cm.weight_bytes(nvfp4) == pytest.approx(w, rel=1e-6)
  assert cm.decode_step_s(1, 100) == pytest.approx((w + 100 * KVT) / (7.7e12 * 0.8), rel=1e-6)
  # The recipe's BF16 tail: 5 of 32 layers (round(0.15 * 32)) stay in BF16.
  tail = Precision("nvfp4", bf16_fraction=5 / 32)
  nq = BLOCKS * 27 / 32
  assert cm.weight_bytes(tail) == pytest.approx(nq * 0.5625 + (N - nq) * 2, rel=1e-6)


def test_trainer_step():
  w = Workload(batch=64, prompt_len=128, horizon=512)
  t = 640
  fwd = 64 * (2 * N * t + 2 * 32 * 4096 * t * (t + 1))
  cm = _model(w, Cluster(H100, 8, 4))
  # forward + backward (2x) + the pi_old recompute, all BF16, over 4 devices.
  assert cm.train_step_s() == pytest.approx(4 * fwd / (4 * BF16_H100), rel=1e-9)
  cm2 = dataclasses.replace(cm, workload=dataclasses.replace(w, epochs=2, recompute_old_logp=False))
  assert cm2.train_step_s() == pytest.approx(6 * fwd / (4 * BF16_H100), rel=1e-9)
  # NVFP4 trainer on B200, backward dequantized (BF16): only the forward's block matmuls at FP4.
  cm3 = CostModel(M8B, w, Cluster(B200, 8, 4), trainer=Precision("nvfp4"))
  fp4, bf16 = 9000e12 * 0.4, 2250e12 * 0.4
  attn = 64 * 2 * 32 * 4096 * t * (t + 1)
  fwd3 = 64 * 2 * t * (BLOCKS / fp4 + (N - BLOCKS) / bf16) + attn / bf16
  bwd3 = 64 * 4 * t * N / bf16 + 2 * attn / bf16
  assert cm3.train_step_s() == pytest.approx((2 * fwd3 + bwd3) / 4, rel=1e-9)


def test_weight_sync():
  cm = _model(cluster=Cluster(H100, 8, 8, sampler_tp=2, sync_gbps=25.0))
  assert cm.sync_s() == pytest.approx(2 * N / (2 * 25e9), rel=1e-9)


def test_steady_state_trainer_bound():
  # 64 sequences on 8 one-device replicas (8 each; P = 16 keeps the prefill memory-bound too);
  # 1 trainer device is slower than one batch's generation, so one batch in flight suffices.
  w = Workload(batch=64, prompt_len=16, horizon=256)
  cm = _model(w, Cluster(H100, 8, 1))
  gen = (256 * 2 * N + 8 * KVT * (16 + sum(16 + j for j in range(1, 256)))) / BW_H100
  train = 4 * 64 * (2 * N * 272 + 2 * 32 * 4096 * 272 * 273) / BF16_H100
  sync = 2 * N / 50e9
  assert gen + sync < train
  ss = cm.steady_state()
  assert ss.in_flight == 1 and ss.bottleneck == "trainer" and ss.rows_per_replica == 8
  assert ss.generate_s == pytest.approx(gen, rel=1e-9)
  assert ss.step_s == pytest.approx(train, rel=1e-9)
  assert ss.lag_steps == pytest.approx(gen / train, rel=1e-9)
  assert ss.lag == math.ceil(gen / train) == 1
  assert ss.samples_per_s == pytest.approx(64 / train, rel=1e-9)
  assert ss.gpu_hours_per_step == pytest.approx(9 * train / 3600, rel=1e-9)
  assert ss.synchronous_step_s == pytest.approx(gen + sync + train, rel=1e-9)
  AsyncSchedule(lag=ss.lag)  # the lag is a valid schedule knob


def test_steady_state_sampler_bound_with_one_batch_in_flight():
  w = Workload(batch=8, prompt_len=64, horizon=256, sync_every=4)
  cm = _model(w, Cluster(H100, 8, 8, max_in_flight=1))
  gen = cm.generate_s(1)
  ss = cm.steady_state()
  assert ss.bottleneck == "sampler" and ss.in_flight == 1
  assert ss.step_s == pytest.approx(gen + cm.sync_s() / 4, rel=1e-9)
  assert ss.lag == 1  # one-step-off pipelining


def test_more_batches_in_flight_keep_the_trainer_busy():
  # Uncapped, the samplers add batches in flight until they keep up: the smallest such k.
  cm = _model(Workload(batch=64, prompt_len=128, horizon=1024), Cluster(H100, 8, 4))
  ss = cm.steady_state()
  assert ss.in_flight > 1 and ss.bottleneck == "trainer"
  period = lambda k: cm.generate_s(k * 8) / k + cm.sync_s()  # noqa: E731  (8 rows per batch)
  assert period(ss.in_flight) <= ss.train_step_s < period(ss.in_flight - 1)
  assert ss.lag == math.ceil(ss.generate_s / ss.train_step_s) > 1


@pytest.mark.parametrize("hardware", ["h100_sxm", "h200", "b200"])
@pytest.mark.parametrize("trainer_devices", [4, 64])
def test_more_sampler_devices_mean_less_staleness(hardware, trainer_devices):
  """At a fixed in-flight bound (prime-rl's async level) more samplers shorten each batch's
  generation, in the sampler-bound (4 trainer devices) and trainer-bound (64) regimes alike."""
  w = Workload(batch=256, prompt_len=256, horizon=2048)
  states = [CostModel(M8B, w, Cluster(HARDWARE[hardware], s, trainer_devices, max_in_flight=2))
            .steady_state() for s in (4, 8, 16, 32, 64)]
  lags = [ss.lag_steps for ss in states]
  assert all(b <= a for a, b in zip(lags, lags[1:])) and lags[-1] < lags[0]
  steps = [ss.step_s for ss in states]
  assert all(b <= a for a, b in zip(steps, steps[1:]))


def test_unbounded_samplers_trade_staleness_for_throughput():
  """Without a bound, sampler-bound pools fill their memory with batches in flight: more devices
  then raise throughput and the lag (each batch takes as long, more are in flight)."""
  w = Workload(batch=256, prompt_len=256, horizon=2048)
  few, many = (CostModel(M8B, w, Cluster(H100, s, 64)).steady_state() for s in (8, 16))
  assert few.bottleneck == many.bottleneck == "sampler"
  assert many.in_flight > few.in_flight and many.samples_per_s > few.samples_per_s
  assert many.lag_steps > few.lag_steps
  capped = CostModel(M8B, w, Cluster(H100, 16, 64, max_in_flight=2)).steady_state()
  assert capped.in_flight == 2 and capped.lag <= 2 and capped.samples_per_s < many.samples_per_s


def test_longer_horizon_means_more_staleness():
  lags = [CostModel(M8B, Workload(batch=256, prompt_len=256, horizon=h),
                    Cluster(H100, 16, 16)).steady_state().lag_steps for h in (64, 256, 1024, 4096)]
  assert all(b > a for a, b in zip(lags, lags[1:]))


@pytest.mark.parametrize("hardware", ["h100_sxm", "b200"])
def test_nvfp4_sampler_decodes_faster_than_mxfp8_than_bf16(hardware):
  cluster = Cluster(HARDWARE[hardware], 8, 8)
  times = [_model(cluster=cluster, sampler=Precision(fmt)).decode_step_s(16, 2048)
           for fmt in ("bf16", "mxfp8_e4m3", "nvfp4")]
  assert times[0] > times[1] > times[2]


def test_precision_of_recipes():
  assert precision_of(precision.recipe("bf16"), 32) == Precision()
  assert precision_of(precision.recipe("fp16"), 32) == Precision()
  assert precision_of(precision.recipe("mxfp8"), 32) == Precision("mxfp8_e4m3")
  assert precision_of(precision.recipe("nvfp4_naive"), 32) == Precision("nvfp4")
  # 4-bitter recipe: round(0.15 * 32) = 5 BF16 tail layers, backward on dequantized (BF16) operands.
  assert precision_of(precision.recipe("nvfp4_recipe"), 32) == Precision("nvfp4", 5 / 32)
  quantized = precision.recipe("nvfp4_naive")
  quantized.backward = "quantized"
  assert precision_of(quantized, 32) == Precision("nvfp4", 0.0, "nvfp4")
  quantized.grad_format = "mxfp8_e4m3"  # an FP8 gradient makes the backward GEMMs FP8
  assert precision_of(quantized, 32).backward_fmt == "mxfp8_e4m3"


@pytest.mark.parametrize("build, match", [
    (lambda: Hardware("x", 0.0, 1.0, None, 1.0, 1.0), "Hardware.bf16_tflops"),
    (lambda: Precision("int8"), "Precision.fmt"),
    (lambda: Precision("nvfp4", bf16_fraction=1.5), "Precision.bf16_fraction"),
    (lambda: ModelSize(10, 11, 1, 8, 8), "n_quantizable=11 exceeds"),
    (lambda: ModelSize(10, 5, 0, 8, 8), "ModelSize.n_layers"),
    (lambda: Workload(batch=0, prompt_len=1, horizon=1), "Workload.batch"),
    (lambda: Workload(batch=1, prompt_len=1, horizon=1, sync_every=0), "Workload.sync_every"),
    (lambda: Cluster(H100, 6, 1, sampler_tp=4), "sampler_tp=4 must divide"),
    (lambda: Cluster(H100, 1, 1, mfu=0.0), "Cluster.mfu"),
    (lambda: Cluster(H100, 1, 1, max_in_flight=0), "Cluster.max_in_flight"),
    (lambda: precision_of(precision.recipe("fp32"), 4), "compute_dtype='float32'"),
])
def test_bad_input_names_the_field(build, match):
  with pytest.raises(ValueError, match=match):
    build()


def test_what_does_not_fit_is_refused():
  # A 70B-class BF16 model (140 GB) on one H100 replica.
  big = ModelSize(70_000_000_000, 60_000_000_000, 80, 8192, 1024)
  cm = CostModel(big, Workload(batch=8, prompt_len=64, horizon=64), Cluster(H100, 8, 8))
  with pytest.raises(ValueError, match="raise Cluster.sampler_tp"):
    cm.steady_state()
  assert CostModel(big, cm.workload, Cluster(H100, 8, 8, sampler_tp=4)).steady_state().lag >= 1
  # One batch's KV cache too large for the memory left next to the weights.
  long = _model(Workload(batch=4096, prompt_len=4096, horizon=32768), Cluster(H100, 1, 1))
  with pytest.raises(ValueError, match="does not fit next to the weights"):
    long.steady_state()


def test_matmul_rates_measured_on_hopper_datasheet_elsewhere():
  """Hopper: the H200 measurement (docs/benchmarks.md: MXFP8 via scaled_dot 0.87-0.94x BF16,
  per-tensor FP8 1.21-1.29x on MLP shapes; 0.90 and 1.25 taken), FP4 at the BF16 rate (no FP4
  tensor cores); B200: its datasheet's dense rates (FP8 4,500, FP4 9,000 TFLOP/s)."""
  from lowrl.asyncrl.cost_model import matmul_flops_per_s
  for name in ("h100_sxm", "h200"):
    hw = HARDWARE[name]
    assert matmul_flops_per_s(hw, "mxfp8_e4m3") == pytest.approx(0.90 * 989.5e12, rel=1e-12)
    assert matmul_flops_per_s(hw, "fp8_e4m3") == pytest.approx(1.25 * 989.5e12, rel=1e-12)
    assert matmul_flops_per_s(hw, "nvfp4") == 989.5e12
    assert matmul_flops_per_s(hw, "mxfp8_e4m3", "datasheet") == 1979.0e12
  assert matmul_flops_per_s(B200, "mxfp8_e4m3") == 4500e12
  assert matmul_flops_per_s(B200, "nvfp4") == 9000e12
  with pytest.raises(ValueError, match="rates"):
    matmul_flops_per_s(B200, "nvfp4", "guessed")
  with pytest.raises(ValueError, match="rates"):
    Cluster(H100, 8, 8, rates="guessed")


def test_mxfp8_trainer_is_slower_than_bf16_on_hopper_and_faster_on_b200():
  """Train step = matmul FLOPs over the rate: the MXFP8 share of it takes 1/0.9 the BF16 time on
  Hopper (measured) and 1/2 on B200 (datasheet); attention stays BF16 in both."""
  def step(hw, fmt, rates="measured"):
    return _model(cluster=Cluster(HARDWARE[hw], 8, 8, rates=rates),
                  trainer=Precision(fmt)).train_step_s()
  assert step("h200", "mxfp8_e4m3") > step("h200", "bf16")
  assert step("h200", "mxfp8_e4m3", "datasheet") < step("h200", "bf16")
  assert step("b200", "mxfp8_e4m3") < step("b200", "bf16")
  assert step("b200", "nvfp4") < step("b200", "mxfp8_e4m3")
