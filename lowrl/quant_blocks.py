"""Quantization blocks vs shards: one check, before any compile, that no quantization block of
any matmul straddles a shard boundary (or a width it does not divide, on one device).

Block formats compute one scale per block along the contracting axis. When no block of any
quantized operand straddles a shard boundary, block scales are shard-local and the sharded
program computes the same quantized values as the unsharded one (per-tensor / per-token amaxes
are exact max-reductions). One device is one shard: the same check covers widths that are not a
multiple of the block.
"""
from __future__ import annotations

from lowrl import precision
from lowrl.models import layout
from lowrl.models.config import ModelConfig
from lowrl.sharding import ShardingPlan, entry_axes


def check_quant_blocks(policy: precision.PrecisionPolicy, model_cfg: ModelConfig,
                       plan: ShardingPlan, *, rows: int | None = None,
                       seq_len: int | None = None, what: str = "precision") -> None:
  """Proves that no quantization block of any matmul straddles a shard boundary.

  Weights are checked along their contracting axis as the rules split it (FSDP and row-parallel
  tensor splits alike). Activations are split along B over the batch axes, so their contracting
  axis is split by the weight's other (tensor) axes: o_proj / down_proj inputs under tensor
  parallelism. 2-D weight blocks are checked along the output axis too. With
  backward="quantized" it also covers the backward GEMMs: the dgrad GEMM contracts the weight's
  output axis (gradient and re-quantized weight), the wgrad GEMM the flattened batch x time axis,
  split over the batch axes (`rows` sequences of `seq_len` tokens per optimizer step, when given).

  Raises:
    ValueError: naming the matmul, the per-shard width, and the fixes.
  """
  for m in layout.matmuls(model_cfg):
    cfg = policy.qdot_config(m.full_path)
    if not cfg.quantized:
      continue
    keys, c_axis, shape = m.param_keys, m.contract_axis, m.weight_shape
    spec = tuple(plan.matmul_spec(m)) + (None,) * len(shape)
    o_axis = m.out_axis  # stacked experts [E, in, out]: blocks never run along E
    contracting = (shape[c_axis], spec[c_axis])
    output = (shape[o_axis], spec[o_axis])
    # Activations are split over the batch axes along B, so only the other (tensor) axes of the
    # weight's contracting entry split their contracting axis.
    act_entry = tuple(a for a in entry_axes(contracting[1]) if a not in plan.batch_axes)
    checks = []
    if cfg.lhs is not None and cfg.lhs.block is not None:
      checks.append(("activations", cfg.lhs, "contracting", contracting[0], act_entry))
    if cfg.rhs is not None and cfg.rhs.block is not None:
      checks.append(("weights", cfg.rhs, "contracting", *contracting))
      if cfg.rhs.block_2d:
        checks.append(("weights", cfg.rhs, "output", *output))
    if cfg.backward == "quantized":
      # The dgrad GEMM contracts the output axis: the re-quantized weight's as the rules split it,
      # the incoming gradient's ([B, T, out]) by the tensor axes only.
      grad_entry = tuple(a for a in entry_axes(output[1]) if a not in plan.batch_axes)
      if cfg.grad is not None and cfg.grad.block is not None:
        checks.append(("dgrad gradient", cfg.grad, "output", output[0], grad_entry))
      if cfg.rhs is not None and cfg.rhs.block is not None and not cfg.rhs.block_2d:
        checks.append(("dgrad weights", cfg.rhs, "output", *output))
      if rows is not None and seq_len is not None:
        tokens = (rows * seq_len, plan.batch_entry)
        for name, q in (("wgrad gradient", cfg.grad), ("wgrad activations", cfg.lhs)):
          if q is not None and q.block is not None:
            checks.append((name, q, "batch x time", *tokens))
    full = m.full_path
    for name, q, axis, width, entry in checks:
      shards = plan.size(entry)
      if width % shards == 0 and (width // shards) % q.block == 0:
        continue
      per = width / shards
      keep = f"keep the matmul unquantized (--config.precision.high_precision_paths='{full}')"
      if axis == "batch x time":
        fix = (f"a batch whose rows per shard times the sequence length ({seq_len}) is a multiple "
               f"of {q.block} (rl.num_prompts * rl.group_size / rl.num_minibatches, "
               "rl.max_new_tokens)")
      elif shards == 1:
        fix = ("a model whose widths are multiples of the block (d_model, d_ff, "
               "n_heads*head_dim, vocab_size for the LM head)"
               + (", precision.weight_block_2d=False" if axis == "output" and q.block_2d else ""))
      else:
        fix = (f"a mesh.rules entry that does not shard this axis of {'/'.join(keys)}, a wider "
               "model")
      if shards == 1:
        raise ValueError(f"{what}: {full} {name} are quantized in {q.fmt} blocks of {q.block} "
                         f"along the {axis} axis, but that axis is {width} wide, not a multiple "
                         f"of {q.block}. Fix: {fix}, or {keep}.")
      raise ValueError(
          f"{what}: {full} {name} are quantized in {q.fmt} blocks of {q.block} along the {axis} "
          f"axis, but that axis ({width} wide) is split {shards} ways over mesh axes "
          f"{entry_axes(entry)}: {per:g} per shard, so blocks would straddle shards. Fix: a mesh "
          f"with fewer devices on {entry_axes(entry)} (mesh.shape), {fix}, or {keep}.")
