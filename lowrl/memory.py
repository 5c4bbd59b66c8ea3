"""Per-device memory and FLOPs of one RL step, from the model config and plain numbers, before
anything is compiled.

`estimate(model_cfg, batch=..., micro_batch=..., seq_len=..., max_new_tokens=..., mesh=(data,
model), ...)` -> MemoryEstimate; `check_fits(est, hbm_bytes)` refuses a config that cannot fit,
naming the knobs to change; `format_estimate` prints it on one screen; `step_time(est, hardware)`
turns the FLOPs into an expected step time at a stated MFU; `device_memory(name)` is the HBM a
`hardware` knob stands for (a preset, or `auto`: what the backend reports). The model's execution
knobs (`model_cfg.remat`, `.attention`, `.attention_chunk`, `.logprob_chunk`: one vocabulary with
lowrl.models.config) select the activation terms.

Sharding assumed (lowrl.sharding's FSDP x tensor-parallel mesh):
- params, grads, optimizer state, reference params and async versions: every leaf split evenly
  over all data x model devices (FSDP), so per device = total / devices (rounded up);
- activations: the batch split over `data` (ceil(micro_batch / data) sequences per device),
  attention heads, the SwiGLU width and the vocabulary split over `model` when the model axis
  divides them (replicated otherwise); the residual stream [B, T, D] is not split over `model`;
- KV cache: rows over `data`, kv heads over `model` only when `model` divides n_kv_heads (else
  the heads are replicated: lowrl's KV cache does that today).
- mixture of experts with `expert_parallel` = e > 1 (lowrl.sharding.expert_parallel_rules on a
  (data / e, expert = e, model) mesh, the batch split over data x expert): the routed experts'
  weights split over all devices, the other weights only over the data / e x model devices
  (replicated over the expert axis). e = 1: every leaf FSDP as above.

Memory terms (bytes per device; c = bytes of the compute dtype):
- params: N x bytes(param_dtype); N = `model_cfg.num_params()` (the param tree is the master
  copy: lowrl keeps no other, see lowrl/training/optimizer.py); of a mixture of experts all E
  experts (`param_counts`: total, routed-expert and active-per-token parameters).
- grads: N x bytes(param_dtype), twice when micro_batch < batch / minibatches (gradient
  accumulation: the accumulator and the current micro-batch's gradient; PPO minibatches are
  optimizer steps of their own and accumulate nothing).
- optimizer: Adam's two moments, 2 N x bytes(optimizer_dtype) (its int32 step counters, a few
  bytes, are left out).
- reference / async versions: N x bytes of their dtype, each.
- KV cache: `transformer.init_cache(model_cfg, rows, seq_len, kv_dtype)`: K and V
  [rows, seq_len, n_kv_heads, head_dim] per layer, a [rows, seq_len] bool mask and an int32
  index. rows = sampler_batch (default: batch), kept between sampler calls.
- activations of one micro-batch of T = seq_len tokens per sequence, what autodiff keeps for the
  backward (Korthikanti et al. 2022, arXiv 2205.05198, counts the same way), per token per layer:
    c x (4 D + 3 q + 3 kv + 3 F)    block input, attn-norm output, q/k/v projections, roped q/k,
                                    attention output, mid residual, mlp-norm output, gate, up,
                                    SwiGLU product (q = H hd, kv = K hd, F = d_ff; a mixture
                                    of experts: F = k moe_d_ff + shared_expert_d_ff, plus
                                    c 2 k D for the gathered expert inputs and outputs and
                                    4 E for the FP32 router logits)
  plus per sequence per layer the attention probabilities H x T x T, once in FP32 (the softmax's
  saved output) and once in the compute dtype (the AV matmul's input): (4 + c) H T^2.
  attention="chunked" saves no scores (each query chunk is rematerialised in the backward): one
  chunk's (4 + c) H C T, C = min(attention_chunk, T), is live at a time (counted once).
  remat="full" (jax.checkpoint per layer) keeps only each layer's input, c D per token, and
  rematerialises one layer at a time in the backward (its full set, with its materialized
  scores, is counted once); remat="dots" (dots_with_no_batch_dims_saveable) also keeps the
  projections' outputs, c (2 D + q + 2 kv + 2 F) per token per layer (o_proj, down, q, k, v,
  gate, up), and rematerialises the rest one layer at a time like "full" (the attention
  einsums have batch dims: their scores are not saved).
  The head: its FP32 input and the final norm's input, (4 + c) D per token; the vocabulary:
  3 FP32 [T, V] arrays per sequence (the logits, the softmax saved by logsumexp, the logits'
  cotangent), or 3 [T, chunk] arrays with `logprob_chunk` > 0.
- sampler prefill (transient, before training): one layer's FP32 scores and probabilities of
  the prompt against the whole cache, (4 + c) H P S per row (C rows of P at a time when
  chunked).
total = params + optimizer + reference + async versions + KV cache
        + max(grads + activations, sampler prefill)
(the sampler and the update do not run at once; the KV cache stays allocated across both).

FLOPs per RL step (global, model FLOPs as in PaLM's MFU, Chowdhery et al. 2022 appendix B, and
Chinchilla, Hoffmann et al. 2022 appendix F): a forward over a sequence of T tokens costs
    F(T) = 2 N_mm T + 4 L q T^2
N_mm = the weights of every matmul (decoder blocks' linear layers + LM head, from
`lowrl.models.layout.matmuls`; the embedding gather and norms are not matmuls; of a mixture of
experts only the k routed experts each token reaches, plus router and shared expert), the attention
term = QK^T and AV over all T x T pairs (4 q FLOPs per query-key pair per layer; causal masking
is not subtracted, as in PaLM; softmax, norms and elementwise ops are ignored). Backward = 2 x
forward. With P = seq_len - max_new_tokens prompt and N = max_new_tokens completion columns:
- sampler prefill, per row: 2 N_blocks P + 2 D V (the head runs on the last column only)
  + 4 L q P^2;
- sampler decode, per row, N - 1 steps (the prefill samples the first token), step j = 1..N-1
  attending to P + j keys: 2 N_mm + 4 L q (P + j);
- trainer: ppo_epochs x 3 F(T) per sequence; scoring: score_forwards x F(T) (pi_old
  recompute); reference: F(T) when a reference is kept;
- remat_recompute: per sequence, ppo_epochs x the forward FLOPs the backward runs again,
  executed but not counted in `total` (MFU counts model FLOPs; hardware FLOPs = total +
  remat_recompute): remat="full" the whole block forward, 2 N_blocks T + 4 L q T^2; "dots" the
  attention einsums, 4 L q T^2; attention="chunked" the attention einsums once more.

Left out: XLA's temporaries and fragmentation, collective buffers (FSDP all-gathers of one layer's
weights), quantized copies of operands in low-precision recipes (fake-quantized weights and
activations, a few extra [B, T, D]-sized arrays per layer), the eval sampler's cache, the host
side, and the rows' padding.
"""
from __future__ import annotations

import dataclasses
import math
import textwrap

from typing import Mapping


from lowrl.hardware import (AUTO, BF16, GB, HARDWARE_CHOICES, NO_LIMIT,  # noqa: F401 (API)
                            Hardware, device_memory, host_memory)
from lowrl.models import layout
from lowrl.models.config import ModelConfig

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "float8_e4m3fn": 1, "float8_e5m2": 1}
# FP32 [T, V] (or [T, chunk]) arrays live per sequence in the logprob forward + backward: the
# logits, the softmax that logsumexp saves for its backward, the logits' cotangent.
VOCAB_ARRAYS = 3


def _cdiv(a: int, b: int) -> int:
  return -(-a // b)


def _split(width: int, heads: int, model: int) -> int:
  """Per-device share of a width made of `heads` units, split over `model` when it divides."""
  return width // model if heads % model == 0 else width


@dataclasses.dataclass(frozen=True)
class StepFlops:
  """Global FLOPs of one RL step (module docstring for the formulas)."""

  sampler_prefill: int
  sampler_decode: int
  trainer: int          # ppo_epochs x (forward + backward)
  scoring: int          # pi_old recompute forwards
  reference: int        # the reference forward (0 without a reference)
  remat_recompute: int  # forwards the backward re-runs (remat, chunks): not in `total`

  @property
  def total(self) -> int:
    """Model FLOPs of the step (what MFU counts)."""
    return (self.sampler_prefill + self.sampler_decode + self.trainer + self.scoring
            + self.reference)


@dataclasses.dataclass(frozen=True)
class MemoryEstimate:
  """Per-device bytes of one RL step's state, and its FLOPs (module docstring for each term).

  `settings` records the inputs (name, value) for display.
  """

  n_devices: int
  params: int
  grads: int
  optimizer: int
  reference: int
  async_versions: int
  kv_cache: int
  act_layers: int        # the blocks' saved tensors other than attention scores
  act_scores: int        # attention probabilities (FP32 + compute dtype): saved or one chunk
  act_head: int          # the LM head's inputs
  act_logits: int        # FP32 [B, T, V] (or [B, T, chunk]) arrays
  sampler_prefill: int   # transient: one layer's (or one chunk's) prefill scores
  decode_hbm_bytes: int  # bytes each device reads over the decode steps (weights + KV cache)
  flops: StepFlops
  settings: tuple[tuple[str, object], ...] = ()
  n_params: int = 0      # parameters in all (`param_counts`)
  n_active: int = 0      # parameters one token's forward uses (MoE: k of the E experts)

  @property
  def activations(self) -> int:
    return self.act_layers + self.act_scores + self.act_head + self.act_logits

  @property
  def persistent(self) -> int:
    """What stays allocated across the whole step."""
    return self.params + self.optimizer + self.reference + self.async_versions + self.kv_cache

  @property
  def total(self) -> int:
    return self.persistent + max(self.grads + self.activations, self.sampler_prefill)


def _dtype_bytes(name: str, flag: str) -> int:
  if name not in DTYPE_BYTES:
    raise ValueError(f"{flag}={name!r}; use one of {sorted(DTYPE_BYTES)}.")
  return DTYPE_BYTES[name]


def _check_int(flag: str, value, minimum: int) -> None:
  if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
    raise ValueError(f"{flag} must be an int >= {minimum}, got {value!r}.")


def matmul_weights(model_cfg: ModelConfig) -> int:
  """N_mm: the weights one token's forward multiplies (decoder blocks + LM head); of a
  mixture of experts the router, the k routed experts a token reaches and the shared expert."""
  k = model_cfg.n_experts_per_tok
  return sum(m.in_features * m.out_features * (k if m.n_experts else 1)
             for m in layout.matmuls(model_cfg))


def param_counts(model_cfg: ModelConfig) -> tuple[int, int, int]:
  """(all parameters, those of the routed experts (all E), those one token's forward uses: all
  but the E - k experts it is not routed to)."""
  n = model_cfg.num_params()
  per_expert = sum(m.in_features * m.out_features for m in layout.matmuls(model_cfg)
                   if m.n_experts)
  experts = model_cfg.n_experts * per_expert
  return n, experts, n - experts + model_cfg.n_experts_per_tok * per_expert


def forward_flops(model_cfg: ModelConfig, tokens: int) -> int:
  """F(T) = 2 N_mm T + 4 L q T^2: one full forward of a sequence of `tokens` tokens."""
  attention = 4 * model_cfg.n_layers * model_cfg.q_dim * tokens * tokens
  return 2 * matmul_weights(model_cfg) * tokens + attention


def estimate(model_cfg: ModelConfig, *, batch: int, micro_batch: int, seq_len: int,
             max_new_tokens: int, mesh: tuple[int, int] = (1, 1), param_dtype: str = "float32",
             optimizer_dtype: str = "float32", compute_dtype: str = "bfloat16",
             keep_reference: bool = True, reference_dtype: str = "float32",
             async_versions: int = 0, async_dtype: str = "float32",
             kv_cache_dtype: str = "bfloat16", sampler_batch: int | None = None,
             ppo_epochs: int = 1, score_forwards: int = 1,
             minibatches: int = 1, expert_parallel: int = 1,
             adapter_params: int = 0, packed_base_bytes: float = 0.0,
             packed_micro_batch: tuple[int, int] | None = None) -> MemoryEstimate:
  """Per-device memory and per-step FLOPs of GRPO-style RL on `model_cfg` (module docstring).

  Args:
    model_cfg: the model, with its execution knobs (remat, attention, attention_chunk,
      logprob_chunk).
    batch: sequences per optimizer step (num_prompts x group_size).
    micro_batch: sequences per forward/backward (gradient accumulation when it is smaller than
      an optimizer step's batch / minibatches).
    seq_len: prompt + completion tokens per sequence (the KV cache's columns).
    max_new_tokens: completion tokens per sequence.
    mesh: (data, model) devices.
    param_dtype: dtype of the param tree (the master weights) and of the gradients.
    optimizer_dtype: dtype of Adam's two moments.
    compute_dtype: dtype of the activations (the precision policy's compute dtype).
    keep_reference, reference_dtype: a reference-policy copy of the params.
    async_versions, async_dtype: older param versions kept for asynchronous sampling.
    kv_cache_dtype: dtype of the sampler's KV cache.
    sampler_batch: rows the sampler decodes at once (None = batch).
    ppo_epochs: optimizer passes over each batch.
    score_forwards: forwards per step that score the batch without a gradient (pi_old).
    minibatches: optimizer steps per pass over the batch (PPO minibatches).
    expert_parallel: devices of `data` on the mesh's expert axis (MoE; divides mesh[0]).
    adapter_params: LoRA adapter parameters (lowrl.models.lora; 0 = full fine-tuning): held
      whole on every device beside the frozen base (in param_dtype, in the reference and the
      versions too, which copy the whole tree); the gradients and Adam's moments then cover the
      adapters alone.
    packed_base_bytes: bytes per parameter of a LoRA base held packed in the trainer
      (lowrl.training.lora_update.pack_base; `quant.packing.bytes_per_param`, e.g. NVFP4 ~0.56)
      for its block linears (attention and MLP kernels, experts included); the embedding, the
      head and the norms stay in param_dtype. 0 = the base in param_dtype. Needs adapter_params.
    packed_micro_batch: (rows, columns) of the update's packed micro-batch (rl.pack_tokens:
      rl.pack_rows rows per data device of rl.pack_tokens columns; lowrl.models.packing): the
      activations are one such micro-batch's, rows x columns tokens and per row H x columns^2
      scores (a packed row attends densely over its width), in place of micro_batch sequences
      of seq_len; the gradients are counted twice (the update accumulates over the packed
      micro-batches in use). None = padded rows. The FLOPs stay the padded batch's (what packing
      saves depends on the lengths).
  """
  cfg = model_cfg
  for flag, value, minimum in (("batch", batch, 1), ("micro_batch", micro_batch, 1),
                               ("seq_len", seq_len, 2), ("max_new_tokens", max_new_tokens, 1),
                               ("async_versions", async_versions, 0),
                               ("ppo_epochs", ppo_epochs, 1),
                               ("score_forwards", score_forwards, 0),
                               ("minibatches", minibatches, 1)):
    _check_int(flag, value, minimum)
  if batch % minibatches:
    raise ValueError(f"minibatches={minibatches} must divide batch={batch}.")
  step_batch = batch // minibatches
  if step_batch % micro_batch:
    raise ValueError(f"micro_batch={micro_batch} must divide batch={batch}"
                     + (f" / minibatches={minibatches}" if minibatches > 1 else "") + ".")
  if max_new_tokens >= seq_len:
    raise ValueError(f"max_new_tokens={max_new_tokens} must be < seq_len={seq_len} (prompt + "
                     "completion); raise seq_len.")
  if seq_len > cfg.max_seq_len:
    raise ValueError(f"seq_len={seq_len} exceeds model_cfg.max_seq_len={cfg.max_seq_len}.")
  if (not isinstance(mesh, tuple) or len(mesh) != 2
      or any(not isinstance(a, int) or isinstance(a, bool) or a < 1 for a in mesh)):
    raise ValueError(f"mesh must be (data, model) positive ints, got {mesh!r}.")
  remat, attention = cfg.remat, cfg.attention  # checked by ModelConfig
  sampler_batch = batch if sampler_batch is None else sampler_batch
  _check_int("sampler_batch", sampler_batch, 1)
  p_bytes = _dtype_bytes(param_dtype, "param_dtype")
  o_bytes = _dtype_bytes(optimizer_dtype, "optimizer_dtype")
  c = _dtype_bytes(compute_dtype, "compute_dtype")
  r_bytes = _dtype_bytes(reference_dtype, "reference_dtype")
  a_bytes = _dtype_bytes(async_dtype, "async_dtype")
  kv_bytes = _dtype_bytes(kv_cache_dtype, "kv_cache_dtype")

  data, model = mesh
  devices = data * model
  _check_int("expert_parallel", expert_parallel, 1)
  if expert_parallel > 1 and (not cfg.is_moe or data % expert_parallel):
    raise ValueError(f"expert_parallel={expert_parallel} needs a mixture-of-experts model and "
                     f"must divide the data devices mesh[0]={data}.")
  n, n_experts, n_active = param_counts(cfg)
  # FSDP over every device; with expert parallelism the non-expert weights over devices / e.
  per_device = lambda b: (_cdiv(n_experts * b, devices)  # noqa: E731
                          + _cdiv((n - n_experts) * b, devices // expert_parallel))
  _check_int("adapter_params", adapter_params, 0)
  held = lambda b: per_device(b) + adapter_params * b  # noqa: E731  (base + adapters)
  if packed_base_bytes:
    if not adapter_params or not 0 < packed_base_bytes < 4:
      raise ValueError(f"packed_base_bytes={packed_base_bytes} needs adapter_params > 0 (a "
                       "frozen LoRA base) and a value in (0, 4) bytes per parameter.")
    # The block linears packed; the rest (embedding, head, norms) in the held dtype. Split like
    # the base (FSDP over every device), the packed part replicated as the trainer holds it.
    n_blocks = matmul_weights(cfg) - cfg.d_model * cfg.vocab_size
    held = lambda b: (per_device(b) - _cdiv(n_blocks * b, devices)  # noqa: E731
                      + math.ceil(n_blocks * packed_base_bytes) + adapter_params * b)
  trained = (lambda b: adapter_params * b) if adapter_params else per_device  # noqa: E731
  params = held(p_bytes)
  if packed_micro_batch is not None:
    if (not isinstance(packed_micro_batch, tuple) or len(packed_micro_batch) != 2
        or any(not isinstance(a, int) or a < 1 for a in packed_micro_batch)):
      raise ValueError(f"packed_micro_batch must be (rows, columns) positive ints, got "
                       f"{packed_micro_batch!r}.")
  accumulates = micro_batch < step_batch or packed_micro_batch is not None
  grads = trained(p_bytes) * (2 if accumulates else 1)
  optimizer = 2 * trained(o_bytes)
  reference = held(r_bytes) if keep_reference else 0
  versions = async_versions * held(a_bytes)

  d, L, T = cfg.d_model, cfg.n_layers, seq_len
  q = _split(cfg.q_dim, cfg.n_heads, model)
  kv = _split(cfg.kv_dim, cfg.n_kv_heads, model)
  f = _split(cfg.d_ff, cfg.d_ff, model)
  if cfg.is_moe:  # per token: k routed experts' hidden widths + the shared expert's
    f = (cfg.n_experts_per_tok * _split(cfg.moe_d_ff, cfg.moe_d_ff, model)
         + _split(cfg.shared_expert_d_ff, cfg.shared_expert_d_ff, model))
  heads = _split(cfg.n_heads, cfg.n_heads, model)
  vocab = _split(cfg.vocab_size, cfg.vocab_size, model)

  rows = _cdiv(sampler_batch, data)
  kv_heads = _split(cfg.n_kv_heads, cfg.n_kv_heads, model)
  kv_cache = 2 * L * rows * T * kv_heads * cfg.head_dim * kv_bytes + rows * T + 4

  # The update's forward/backward: micro_batch padded rows of T, or the packed micro-batch's.
  seqs = _cdiv(micro_batch if packed_micro_batch is None else packed_micro_batch[0], data)
  width = T if packed_micro_batch is None else packed_micro_batch[1]
  tokens = seqs * width
  layer_per_token = c * (4 * d + 3 * q + 3 * kv + 3 * f)
  if cfg.is_moe:  # the k gathered expert inputs and outputs, the FP32 router logits
    layer_per_token += c * 2 * cfg.n_experts_per_tok * d + 4 * cfg.n_experts
  chunked = attention == "chunked"
  # Query rows whose scores are live at once: a row's width (materialized) or one chunk.
  score_rows = min(cfg.attention_chunk, width) if chunked else width
  scores_per_layer = seqs * heads * score_rows * width * (4 + c)
  if remat == "none":
    act_layers = L * tokens * layer_per_token
    act_scores = scores_per_layer if chunked else L * scores_per_layer
  else:  # saved per layer, plus one layer rematerialised at a time in the backward
    saved = d if remat == "full" else 3 * d + q + 2 * kv + 2 * f
    act_layers = L * tokens * c * saved + tokens * layer_per_token
    act_scores = scores_per_layer
  act_head = tokens * (4 + c) * d
  vocab_width = min(cfg.logprob_chunk, vocab) if cfg.logprob_chunk else vocab
  act_logits = VOCAB_ARRAYS * tokens * vocab_width * 4

  prompt = seq_len - max_new_tokens
  prefill_rows = min(cfg.attention_chunk, prompt) if chunked else prompt
  sampler_prefill = rows * heads * prefill_rows * T * (4 + c)
  decode_steps = max_new_tokens - 1
  n_mm = matmul_weights(cfg)
  n_head = cfg.d_model * cfg.vocab_size
  n_blocks = n_mm - n_head
  key_sum = decode_steps * prompt + decode_steps * (decode_steps + 1) // 2  # sum_j (P + j)
  n_read = n_mm
  if cfg.is_moe:  # a decode step's rows together reach up to E experts, each read once
    per_expert = sum(m.in_features * m.out_features for m in layout.matmuls(cfg) if m.n_experts)
    n_read += (min(cfg.n_experts, rows * cfg.n_experts_per_tok)
               - cfg.n_experts_per_tok) * per_expert
  decode_hbm = (decode_steps * _cdiv(n_read * c, model)
                + rows * 2 * L * kv_heads * cfg.head_dim * kv_bytes * key_sum)

  attn = 4 * L * cfg.q_dim
  fwd = forward_flops(cfg, T)
  flops = StepFlops(
      sampler_prefill=sampler_batch * (2 * n_blocks * prompt + 2 * n_head + attn * prompt ** 2),
      sampler_decode=sampler_batch * (decode_steps * 2 * n_mm + attn * key_sum),
      trainer=ppo_epochs * batch * 3 * fwd,
      scoring=score_forwards * batch * fwd,
      reference=batch * fwd if keep_reference else 0,
      remat_recompute=ppo_epochs * batch * (
          (2 * n_blocks * T if remat == "full" else 0)
          + attn * T * T * ((remat != "none") + chunked)))
  settings = (("mesh", f"data={data} x model={model}"), ("batch", batch),
              ("micro_batch", micro_batch), ("seq_len", seq_len),
              ("max_new_tokens", max_new_tokens), ("sampler_batch", sampler_batch),
              ("param_dtype", param_dtype), ("optimizer_dtype", optimizer_dtype),
              ("compute_dtype", compute_dtype), ("minibatches", minibatches),
              ("reference", reference_dtype if keep_reference else "none"),
              ("async_versions", f"{async_versions} x {async_dtype}"), ("remat", remat),
              ("attention", attention + (f" ({cfg.attention_chunk} rows)" if chunked else "")),
              ("logprob_chunk", cfg.logprob_chunk),
              ("kv_cache_dtype", kv_cache_dtype), ("ppo_epochs", ppo_epochs),
              ("score_forwards", score_forwards))
  if packed_micro_batch is not None:
    settings += (("packed_micro_batch", "%d rows x %d" % packed_micro_batch),)
  if adapter_params:
    settings += (("lora_adapter_params", adapter_params),)
  if packed_base_bytes:
    settings += (("lora_packed_base", f"{packed_base_bytes:.4f} bytes/param"),)
  if cfg.is_moe:
    settings += (("experts", f"{cfg.n_experts} (top-{cfg.n_experts_per_tok})"),
                 ("expert_parallel", expert_parallel))
  return MemoryEstimate(
      n_devices=devices, params=params, grads=grads, optimizer=optimizer, reference=reference,
      async_versions=versions, kv_cache=kv_cache, act_layers=act_layers, act_scores=act_scores,
      act_head=act_head, act_logits=act_logits, sampler_prefill=sampler_prefill,
      decode_hbm_bytes=decode_hbm, flops=flops, settings=settings, n_params=n,
      n_active=n_active)


# The knobs that shrink each term, in `estimate`'s and ModelConfig's names (check_fits's default;
# a binary passes its own flag names for the same keys).
KNOB_HINTS = {
    "blocks": "lower micro_batch or remat='full'",
    "scores": "lower micro_batch or attention='chunked'",
    "logits": "set logprob_chunk or lower micro_batch",
    "params": "param_dtype='bfloat16' or more devices (mesh)",
    "grads": "param_dtype='bfloat16' or more devices (mesh)",
    "optimizer": "more devices (mesh) or optimizer_dtype='bfloat16'",
    "reference": "reference_dtype='bfloat16' or keep_reference=False",
    "versions": "async_dtype='bfloat16' or fewer async_versions",
    "kv_cache": "lower sampler_batch or kv_cache_dtype",
    "prefill": "lower sampler_batch or attention='chunked'",
    "devices": "more devices (mesh)",
}


def _terms(est: MemoryEstimate) -> list[tuple[str, str, int]]:
  """(KNOB_HINTS key, term, bytes), for check_fits."""
  return [
      ("blocks", "activations: blocks", est.act_layers),
      ("scores", "activations: attention scores", est.act_scores),
      ("logits", "activations: logits", est.act_logits),
      ("params", "params", est.params),
      ("grads", "grads", est.grads),
      ("optimizer", "optimizer", est.optimizer),
      ("reference", "reference", est.reference),
      ("versions", "async versions", est.async_versions),
      ("kv_cache", "KV cache", est.kv_cache),
      ("prefill", "sampler prefill", est.sampler_prefill),
  ]


def check_fits(est: MemoryEstimate, hbm_bytes: float, headroom: float = 0.9,
               hints: Mapping[str, str] | None = None, what: str = "HBM") -> None:
  """Raises ValueError naming the knobs to change when est.total > headroom x hbm_bytes.

  The message lists the largest terms first, each with the knobs that shrink it: `hints`, keyed
  like KNOB_HINTS (default), so a binary can name its own flags.
  """
  if not 0 < headroom <= 1:
    raise ValueError(f"headroom must be in (0, 1], got {headroom}.")
  hints = KNOB_HINTS if hints is None else hints
  missing = sorted(set(KNOB_HINTS) - set(hints))
  if missing:
    raise ValueError(f"hints lacks the keys {missing} (see memory.KNOB_HINTS).")
  budget = headroom * hbm_bytes
  if est.total <= budget:
    return
  big = sorted((t for t in _terms(est) if t[2] > 0), key=lambda t: -t[2])[:4]
  text = "; ".join(f"{name} {b / GB:.1f} GB ({hints[key]})" for key, name, b in big)
  raise ValueError(f"per-device memory estimate {est.total / GB:.1f} GB exceeds {headroom:g} x "
                   f"{hbm_bytes / GB:.1f} GB of {what}; largest terms: {text}; params, grads, "
                   f"optimizer and reference also shrink with {hints['devices']}.")


@dataclasses.dataclass(frozen=True)
class StepTime:
  """Expected seconds of one RL step on `n_devices` chips (see `step_time`)."""

  compute_s: float      # every model FLOP at mfu x the chips' rate
  decode_hbm_s: float   # the decode's HBM reads at full bandwidth (a lower bound)
  step_s: float         # FLOPs outside the decode at mfu + max(decode at mfu, decode_hbm_s)
  mfu: float


def step_time(est: MemoryEstimate, hw: Hardware, *, mfu: float = 0.4,
              fmt: str = BF16) -> StepTime:
  """Expected step time: all model FLOPs at `mfu` x the `fmt` tensor rate of every device, except
  that the decode takes at least its HBM reads (weights + KV cache, `decode_hbm_bytes`) at full
  bandwidth. Communication, host work and the remat recompute are not modelled."""
  if not 0 < mfu <= 1:
    raise ValueError(f"mfu must be in (0, 1], got {mfu}.")
  rate = est.n_devices * hw.flops_per_s(fmt) * mfu
  decode_compute = est.flops.sampler_decode / rate
  decode_hbm = est.decode_hbm_bytes / (hw.hbm_tbps * 1e12)
  rest = (est.flops.total - est.flops.sampler_decode) / rate
  return StepTime(compute_s=est.flops.total / rate, decode_hbm_s=decode_hbm,
                  step_s=rest + max(decode_compute, decode_hbm), mfu=mfu)


def _fmt_flops(x: float) -> str:
  return f"{x:.3e}"


def format_count(n: int) -> str:
  """A parameter count to three significant digits in the unit that shows them: 800256 ->
  '800 K', 7615616512 -> '7.62 B' (in billions alone a tiny model printed as 0.00 B)."""
  for unit, scale in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
    if n >= scale:
      v = n / scale
      return f"{v:.{2 if v < 10 else 1 if v < 100 else 0}f} {unit}"
  return str(int(n))


def format_estimate(est: MemoryEstimate, hw: Hardware | None = None, mfu: float = 0.4) -> str:
  """A one-screen table of `est` (and, given `hw`, the HBM fit and the step time at `mfu`)."""
  lines = textwrap.wrap("settings: " + ", ".join(f"{k}={v}" for k, v in est.settings), 96)
  if est.n_params:
    lines.append(f"parameters: {format_count(est.n_params)}, {format_count(est.n_active)} "
                 "active per token")
  lines += ["",
           f"{'per-device memory':<34}{'GB':>10}"]
  rows = [("params", est.params), ("grads", est.grads), ("optimizer (Adam, 2 moments)",
                                                          est.optimizer),
          ("reference params", est.reference), ("async versions", est.async_versions),
          ("KV cache", est.kv_cache), ("activations", est.activations),
          ("  blocks", est.act_layers), ("  attention scores", est.act_scores),
          ("  LM head inputs", est.act_head), ("  logits [B, T, V] FP32", est.act_logits),
          ("sampler prefill (transient)", est.sampler_prefill)]
  lines += [f"{name:<34}{b / GB:>10.2f}" for name, b in rows]
  lines.append(f"{'total':<34}{est.total / GB:>10.2f}")
  if hw is not None:
    lines.append(f"{'HBM of one ' + hw.name:<34}{hw.hbm_gb:>10.2f}"
                 f"   ({100 * est.total / hw.hbm_bytes:.0f}% used)")
  lines += ["", f"{'FLOPs per RL step (all devices)':<34}{'FLOPs':>10}"]
  f = est.flops
  for name, x in (("sampler prefill", f.sampler_prefill), ("sampler decode", f.sampler_decode),
                  ("trainer fwd + bwd", f.trainer), ("pi_old scoring fwd", f.scoring),
                  ("reference fwd", f.reference), ("total (model FLOPs)", f.total),
                  ("remat recompute (not in total)", f.remat_recompute)):
    lines.append(f"{name:<34}{_fmt_flops(x):>10}")
  if hw is not None:
    t = step_time(est, hw, mfu=mfu)
    lines += ["", f"step time on {est.n_devices} x {hw.name} at {100 * mfu:.0f}% MFU "
              f"(BF16 {hw.bf16_tflops:g} TFLOP/s):",
              f"  all FLOPs at MFU {t.compute_s:10.2f} s",
              f"  decode HBM bound {t.decode_hbm_s:10.2f} s",
              f"  expected step    {t.step_s:10.2f} s"]
  return "\n".join(lines)

