"""What TensorBoard shows first: the TensorBoard tag of each logged metric, and a custom-scalars
layout (docs/configuration.md, "TensorBoard").

TensorBoard's Time Series and Scalars dashboards group charts by a tag's first path component,
list the groups in sorted order and open only the first ones. A run logs ~20 flat keys
(`clip_frac`, `entropy`, ...), each a group of its own, and `reward` would sort 16th, folded. So
the tags are a view of metrics.jsonl's keys (which stay as they are): the groups a reader looks
at first carry a digit prefix that sorts before every letter (`1_reward`, `2_eval`, `3_run`),
and the flat keys are gathered into a few named groups (`update`, `batch`, `async`).
"""
from __future__ import annotations

from typing import Any

# The TensorBoard runs of a workdir's tb/: the RL steps (with the evaluations) and the SFT of the
# base (its steps are SFT steps). Named directories: a run at tb/ itself is listed as ".".
RL_RUN, SFT_RUN = "rl", "sft"
# Key prefix -> tag prefix of the groups shown first, in this order.
FIRST_GROUPS = (("reward/", "1_reward/"), ("eval/", "2_eval/"), ("run/", "3_run/"))
# The evaluations' confidence bounds (`eval/pass_at_1_ci_low`, ...): a group of their own after
# the first ones, so that 2_eval holds the two accuracies only.
EVAL_CI_GROUP, EVAL_CI_SUFFIXES = "eval_ci/", ("_ci_low", "_ci_high")
# Flat keys that are not the update's own (the rest of the flat keys go to `update/`).
FLAT_GROUPS = {"response_length": "batch", "groups_kept": "batch",
               "sampler_version_lag": "async", "versions_held": "async"}
# The weight quantization errors' histogram (one entry per quantized weight, in percent: the
# relative errors sit within ~1e-3 of each other, and TensorBoard's axis labels of such
# fractions are six digits long and run into each other).
WEIGHT_ERROR_HISTOGRAM = "quant_error_hist/weights_pct"


def tag(key: str) -> str:
  """The TensorBoard tag of metrics key `key` (a key already mapped is returned unchanged)."""
  if key.startswith("eval/") and key.endswith(EVAL_CI_SUFFIXES):
    return EVAL_CI_GROUP + key[len("eval/"):]
  for prefix, first in FIRST_GROUPS:
    if key.startswith(prefix):
      return first + key[len(prefix):]
  if "/" in key:
    return key
  return f"{FLAT_GROUPS.get(key, 'update')}/{key}"


def _with_ci(key: str) -> list[str]:
  """[value, lower, upper] tags of an evaluation metric and its confidence bounds."""
  return [tag(key)] + [tag(key + s) for s in EVAL_CI_SUFFIXES]


def custom_scalars() -> dict[str, dict[str, list[Any]]]:
  """The CUSTOM SCALARS dashboard's layout (tensorboardX `add_custom_scalars`): training reward
  next to the held-out evaluation, then the run's pace, then sampler/trainer drift.

  Multiline entries are regular expressions over tags; Margin entries are [value, lower, upper]
  tags. The held-out evaluations are Margin charts with their 95% interval over the prompts:
  TensorBoard's default "ignore outliers in chart scaling" fits the y-axis to the 5%-95%
  quantiles of a chart's points, which for a line of <= 21 points drops its lowest and highest
  (the step-0 and the final evaluation, typically); the bounds drawn around each point widen the
  range so the points stay on the chart (docs/configuration.md, "TensorBoard")."""
  return {
      "1 reward and held-out evaluation": {
          "held-out pass@1 (95% interval over the eval prompts)": [
              "Margin", _with_ci("eval/pass_at_1")],
          "held-out greedy accuracy (95% interval over the eval prompts)": [
              "Margin", _with_ci("eval/greedy")],
          "pass rate: train (rollouts) vs held-out pass@1": [
              "Multiline", [r"^1_reward/pass_rate$", r"^2_eval/pass_at_1$"]],
          "train reward": ["Multiline", [r"^1_reward/mean$"]],
      },
      "2 pace": {
          "learning rate": ["Multiline", [r"^3_run/lr$"]],
          "step time (s)": ["Multiline", [r"^3_run/step_time_s$"]],
          "sampled tokens per second": ["Multiline", [r"^3_run/tokens_per_s$"]],
      },
      "3 drift": {
          "sampler vs trainer KL": ["Multiline", [r"^mismatch/mismatch_kl(_k3)?$"]],
          "effective sample size": ["Multiline", [r"^mismatch/ess$"]],
          "gradient norm": ["Multiline", [r"^update/grad_norm$"]],
      },
  }
