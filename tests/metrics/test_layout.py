"""TensorBoard tags and custom-scalars layout: reward, evaluation and the run's pace sort first,
every metric keeps a tag of its own, and the layout's charts name tags that exist."""
import re

import numpy as np
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from tensorboard.plugins.custom_scalar import layout_pb2

from lowrl.metrics import layout
from lowrl.metrics.writer import MetricWriter
from lowrl.training.step import BATCH_METRICS

# The keys of one logged step of the main job (metrics.jsonl's columns) and the pace's.
KEYS = ("clip_frac", "correction/is_weight_mean", "entropy", "grad_norm", "grad_norm_max",
        "kl_ref", "loss", "mismatch/ess", "mismatch/mismatch_kl", "mismatch/mismatch_kl_k3",
        "pg_loss", "ratio_mean", "skipped_updates", "drift/total/mismatch_kl",
        "sampler_version_lag", "versions_held", "quant_error/layers_0/attn/q_proj",
        "refit/mismatched_tensors", "update_erasure", "grad_bias/cosine", "eval/pass_at_1",
        "eval/pass_at_1_ci_low", "eval/pass_at_1_ci_high", "eval/greedy", "eval/greedy_ci_low",
        "eval/greedy_ci_high", "run/lr", "run/step_time_s", "run/tokens_per_s", *BATCH_METRICS)


def _group(tag: str) -> str:
  return tag.split("/")[0]


def test_reward_evaluation_and_pace_are_the_first_groups():
  tags = [layout.tag(k) for k in KEYS]
  groups = sorted({_group(t) for t in tags})  # TensorBoard lists groups in sorted order
  assert groups[:3] == ["1_reward", "2_eval", "3_run"]
  assert len(groups) <= 13  # flat keys gathered, not one group each (20 before; eval_ci added)
  assert layout.tag("reward/mean") == "1_reward/mean"
  assert layout.tag("clip_frac") == "update/clip_frac"
  assert layout.tag("response_length") == "batch/response_length"
  assert layout.tag("drift/total/mismatch_kl") == "drift/total/mismatch_kl"  # grouped already
  # 2_eval holds the two accuracies; their intervals are a group of their own.
  assert sorted(t for t in tags if t.startswith("2_eval/")) == ["2_eval/greedy",
                                                                "2_eval/pass_at_1"]
  assert layout.tag("eval/pass_at_1_ci_low") == "eval_ci/pass_at_1_ci_low"


def test_tags_are_distinct_stable_and_valid_tensorboard_names():
  tags = [layout.tag(k) for k in KEYS]
  assert len(set(tags)) == len(KEYS)
  assert [layout.tag(t) for t in tags] == tags  # mapping a tag again changes nothing
  # TensorBoard's (and tensorboardX's) tag alphabet; other characters would be replaced.
  assert all(re.fullmatch(r"[-/\w.]+", t) for t in tags), tags


def test_every_custom_scalars_chart_matches_a_logged_tag():
  tags = [layout.tag(k) for k in KEYS]
  for category, charts in layout.custom_scalars().items():
    for title, (kind, patterns) in charts.items():
      if kind == "Margin":  # [value, lower, upper]: tags, not patterns
        assert len(patterns) == 3 and set(patterns) <= set(tags), (category, title, patterns)
        continue
      assert kind == "Multiline"
      for p in patterns:
        assert any(re.search(p, t) for t in tags), (category, title, p)


def _domain_ignoring_outliers(values) -> tuple[float, float]:
  """The custom-scalars chart's y-range with "ignore outliers in chart scaling" on (TensorBoard
  2.21's vz-line-chart2: d3's linear-interpolated 5% and 95% quantiles of every value, lower and
  upper bound of the chart's points)."""
  return tuple(np.quantile(np.asarray(values, np.float64), (0.05, 0.95)))


def test_the_held_out_charts_keep_the_first_and_last_evaluation():
  """The main job's held-out pass@1 (steps 0, 10, ..., 40), whose lowest and highest points a
  line chart's 5%-95% range drops, stays inside the Margin chart's range with its intervals."""
  charts = layout.custom_scalars()["1 reward and held-out evaluation"]
  kind, tags = charts["held-out pass@1 (95% interval over the eval prompts)"]
  assert kind == "Margin" and tags == ["2_eval/pass_at_1", "eval_ci/pass_at_1_ci_low",
                                       "eval_ci/pass_at_1_ci_high"]
  values = np.array([0.481, 0.568, 0.597, 0.606, 0.639])
  lo, hi = _domain_ignoring_outliers(values)
  assert lo > values.min() and hi < values.max()  # a plain line: step 0 and step 40 cropped
  rng = np.random.default_rng(0)
  for _ in range(100):  # any 2..7 points with any intervals around them
    n = int(rng.integers(2, 8))
    v = rng.uniform(0, 1, n)
    low, high = v - rng.uniform(0, 0.1, n), v + rng.uniform(0, 0.1, n)
    lo, hi = _domain_ignoring_outliers(np.concatenate([v, low, high]))
    assert lo <= v.min() and hi >= v.max()


def test_custom_scalars_layout_and_mapped_tags_round_trip(tmp_path):
  with MetricWriter(tmp_path, tags=layout.tag) as w:
    w.custom_scalars(layout.custom_scalars())
    w.scalars(1, {"reward/mean": 0.5, "clip_frac": 0.1})
    w.histograms(1, {layout.WEIGHT_ERROR_HISTOGRAM: [8.6, 8.7]})
    w.hparams({"optimizer.lr": 1e-3}, ["eval/pass_at_1"])
  acc = EventAccumulator(str(tmp_path), size_guidance={"scalars": 0, "tensors": 0})
  acc.Reload()
  assert sorted(acc.Tags()["scalars"]) == ["1_reward/mean", "update/clip_frac"]
  assert acc.Tags()["histograms"] == [layout.WEIGHT_ERROR_HISTOGRAM]
  raw = acc.Tensors("custom_scalars__config__")[0].tensor_proto.string_val[0]
  got = layout_pb2.Layout.FromString(raw)
  want = layout.custom_scalars()
  assert [c.title for c in got.category] == list(want)
  for category, charts in zip(got.category, want.values()):
    assert [c.title for c in category.chart] == list(charts)
    for chart, (kind, patterns) in zip(category.chart, charts.values()):
      if kind == "Margin":
        s = chart.margin.series[0]
        assert [s.value, s.lower, s.upper] == patterns
      else:
        assert list(chart.multiline.tag) == patterns
