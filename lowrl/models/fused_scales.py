"""One per-tensor weight scale for the matmuls an inference engine fuses.

vLLM loads q/k/v as one linear (`qkv_proj`) and gate/up as another (`gate_up_proj`). For NVFP4 in
ModelOpt's layout it keeps the block scales as stored and takes `weight_scale_2.max()` over the
partitions (vllm-project/vllm@00155cde, `vllm/model_executor/layers/quantization/modelopt.py`,
`ModelOptNvFp4LinearMethod.process_weights_after_loading`, with a warning when they differ), so a
partition quantized with a smaller outer scale of its own is read rescaled by the ratio. ModelOpt's
exporter unifies the amax of such partitions before quantizing (`preprocess_linear_fusion`,
NVIDIA/Model-Optimizer `modelopt/torch/export/quant_utils.py`). Under
`PrecisionPolicy.weight_scales == "fused"` lowrl does the same everywhere a weight is quantized
(the model's forward, the sampler's rollout weights, the export): every partition of a group in
`layout.FUSED_GROUPS` whose weight quantizer is the group's and has a per-tensor scale (FP8,
NVFP4 without per_token) is quantized with the group's joint amax as its static `tensor_amax`.
The joint amax is max |W| over the partitions, exact (a max), so it is the per-tensor amax of the
engine's fused weight, and each partition's own elements never exceed it (no saturation).
"""
from __future__ import annotations

from typing import Mapping

import jax
import jax.numpy as jnp

from lowrl.models import layout
from lowrl.models.config import ModelConfig
from lowrl.precision import PrecisionPolicy
from lowrl.quant.config import QuantConfig


def _has_tensor_scale(q: QuantConfig | None) -> bool:
  return q is not None and q.kind in ("tensor", "nvfp4") and not q.per_token


def shared_groups(policy: PrecisionPolicy, layer: int) -> tuple[tuple[str, ...], ...]:
  """Block paths of layer `layer` ("attn/q_proj", ...) that share one per-tensor weight scale
  under `policy`: per fused group, its partitions with that group's (first partition's) weight
  quantizer, when there are two or more of them. Static (from the policy alone)."""
  if policy.weight_scales != "fused":
    return ()
  out = []
  for group in layout.FUSED_GROUPS:
    rhs = {p: policy.qdot_config(layout.matmul_path(layer, p)).rhs for p in group}
    first = rhs[group[0]]
    members = tuple(p for p in group if _has_tensor_scale(rhs[p]) and rhs[p] == first)
    if len(members) > 1:
      out.append(members)
  return tuple(out)


def joint_amax(kernels: Mapping[str, jax.Array], group: tuple[str, ...]) -> jax.Array:
  """max |W| over the group's kernels (FP32 scalar; NaN if any holds a NaN)."""
  return jnp.max(jnp.stack([jnp.max(jnp.abs(kernels[p].astype(jnp.float32))) for p in group]))


def weight_amax(policy: PrecisionPolicy, layer: int,
                kernels: Mapping[str, jax.Array]) -> dict[str, jax.Array]:
  """{block path: the static per-tensor amax its weight quantizer takes} for the shared
  partitions of layer `layer` (`shared_groups`); `kernels` maps block paths to that layer's
  kernels (at least the shared ones). Other paths are absent: they take their own amax.
  Traceable; its value gets no gradient through the quantizers (static amaxes don't)."""
  out = {}
  for group in shared_groups(policy, layer):
    if not all(p in kernels for p in group):  # a layer without them (an MoE layer's MLP)
      continue
    amax = joint_amax(kernels, group)
    out.update({p: amax for p in group})
  return out


def weight_amaxes(params: Mapping, model_cfg: ModelConfig, policy: PrecisionPolicy
                  ) -> dict[str, jax.Array]:
  """{full path ("layers_0/attn/q_proj"): static per-tensor amax} of every weight whose
  per-tensor scale its fused group shares (`weight_amax` per layer), from a whole param tree;
  the other weights are absent (they take their own amax). Traceable."""
  out = {}
  for i in range(model_cfg.n_layers):
    groups = shared_groups(policy, i)
    if groups:
      layer = params[layout.layer_key(i)]
      kernels = layer_kernels(layer, [p for g in groups for p in g if _has_kernel(layer, p)])
      out.update({layout.matmul_path(i, p): a
                  for p, a in weight_amax(policy, i, kernels).items()})
  return out


def _has_kernel(layer_params: Mapping, path: str) -> bool:
  node = layer_params
  for k in path.split("/"):
    if k not in node:
      return False
    node = node[k]
  return "kernel" in node


def layer_kernels(layer_params: Mapping, paths) -> dict[str, jax.Array]:
  """{block path: kernel} read from one layer's param subtree (`{'attn': {'q_proj': ...}}`)."""
  out = {}
  for p in paths:
    node = layer_params
    for k in p.split("/"):
      node = node[k]
    out[p] = node["kernel"]
  return out
