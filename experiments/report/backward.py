"""The seed's backward question: is the dequantized backward (the quantized forward's exact
gradient with the weights' quantization passed straight through) better than a backward that
quantizes its own GEMMs, or one in high precision?

Tested on identical batches and weights (experiments/paired.py `backward`, at the base and at a
mid-run checkpoint), paired by batch, and in the training runs' gradient probes, paired by seed.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from experiments.report import common
from lowrl.analysis import stats

# (key, what, a, b, direction, statement): the paired-batch comparisons of the backward modes.
COMPARISONS = (
    ("cos_fp32", "cosine to the FP32 gradient", "dequantized", "quantized", +1,
     "The dequantized backward's gradient is closer to FP32 than the quantized one's"),
    ("cos_fp32", "cosine to the FP32 gradient", "dequantized", "high_precision", +1,
     "The dequantized backward's gradient is closer to FP32 than the high-precision one's"),
    ("cos_exact", "cosine to the quantized forward's exact (dequantized) gradient",
     "quantized", "high_precision", +1,
     "The quantized backward approximates the quantized forward's gradient better than the "
     "high-precision one"),
    ("heldout_delta", "held-out surrogate change after one AdamW step", "dequantized",
     "quantized", -1, "One update with the dequantized backward lowers the held-out loss more "
     "than with the quantized one"),
    ("heldout_delta", "held-out surrogate change after one AdamW step", "dequantized",
     "high_precision", -1, "One update with the dequantized backward lowers the held-out loss "
     "more than with the high-precision one"))


def probe_claim(results: list[dict[str, Any]]) -> stats.Claim | None:
  """The training probes' gradient cosine to FP32, dequantized vs quantized backward, by seed."""
  return common.seed_claim(results, "backward_probe", "The dequantized backward's gradient is "
                           "closer to FP32 than the quantized one's (training probes)",
                           "nvfp4_recipe", "nvfp4_recipe_qbwd", common.get("grad_cos"), +1,
                           "mean gradient cosine vs FP32 over the probe steps")


def backward_claims(bwd: dict[str, Any], where: str,
                    mid_run: bool = False) -> list[stats.Claim]:
  """The backward modes' claims on one paired.py backward line (identical batches and weights,
  `where`: the base or a mid-run checkpoint), paired by batch; mid-run ids end in "_mid"."""
  modes = bwd.get("modes", {})
  suffix, tag = ("_mid", " (mid-run)") if mid_run else ("", "")
  design = (f"identical batches and weights ({where}), gradient of the recipe's forward with each "
            "backward; {what}; {a} - {b}, paired by batch")
  out = []
  for key, what, a, b, direction, statement in COMPARISONS:
    if a in modes and b in modes:
      d = np.asarray(modes[a][key]) - np.asarray(modes[b][key])
      out.append(stats.Claim(f"backward_{key}_{a}_vs_{b}{suffix}", statement + tag,
                             design.format(what=what, a=a, b=b), stats.paired_t(d), direction,
                             note=f"sign test p {stats.fmt_p(stats.sign_test(d))}"))
  return out


def paired_claims(paired: dict[str, Any]) -> list[stats.Claim]:
  """The backward claims at the base and, where measured, mid-run."""
  out = backward_claims(paired.get("backward", {}), "the base")
  mid = paired.get("backward_mid", {})
  if mid.get("modes"):
    out += backward_claims(mid, f"mid-run: {mid['weights']}", mid_run=True)
  return out


def sections(paired: dict[str, Any]) -> list[str]:
  """What one update changes in each quantized forward, and the backward modes' per-arm numbers
  (mean [95% CI] over batches) at the base and mid-run."""
  md = []
  ci = lambda v: common.mean_ci(stats.paired_t(v))  # noqa: E731
  by_fwd = paired.get("backward", {}).get("churn_by_forward", {})
  if by_fwd:
    md += ["### What one update changes in each quantized forward", "",
           "The dequantized backward's one AdamW step from the base on each batch (the backward "
           "design below), seen through each setting's trainer forward: the fraction of its "
           "quantized weights' codes and block scales the step changes (mean [95% CI] over "
           "batches).", "",
           "| forward | batches | codes changed | block scales changed |", "|---|---|---|---|"]
    for name, c in by_fwd.items():
      md.append(f"| {name} | {len(c['codes'])} | {ci(c['codes'])} | {ci(c['scales'])} |")
    md.append("")
  for key, where in (("backward", "the base"), ("backward_mid", "mid-run")):
    bwd = paired.get(key, {})
    if not bwd.get("modes"):
      continue
    at = "" if key == "backward" else f", mid-run ({bwd['weights']} of {bwd['steps']})"
    md += [f"### Backward modes on identical batches{at}", "",
           "| backward | batches | cos vs FP32 | rel err vs FP32 | cos vs exact quantized-forward "
           "gradient | held-out surrogate change after one step | NVFP4 codes the step changes |",
           "|---|---|---|---|---|---|---|"]
    for mode, m in bwd["modes"].items():
      def cell(k, m=m):
        return ci(m[k]) if k in m else "–"
      md.append(f"| {mode} | {len(m['heldout_delta'])} | {cell('cos_fp32')} | "
                f"{cell('rel_err_fp32')} | {cell('cos_exact')} | {cell('heldout_delta')} | "
                f"{cell('code_churn')} |")
    md += ["", f"Held-out surrogate at {where}: {bwd['heldout_base']:.5f} (lower is better; the "
           "fp32 row is the update on the FP32 gradient of the unquantized model).", ""]
  return md
