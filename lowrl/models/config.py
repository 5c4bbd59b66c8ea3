"""ModelConfig: the shape of a Llama/Qwen-family decoder, and a few presets.

Frozen (hashable) so it can be a static argument of `jax.jit`. Field names and defaults are the
contract in ARCHITECTURE.md; the Hugging Face config reader (lowrl/checkpoints/hf_config.py) builds these.
"""
from __future__ import annotations

import dataclasses

REMAT_MODES = ("none", "full", "dots")
ATTENTION_MODES = ("materialized", "chunked")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """Decoder hyper-parameters.

  Attributes:
    vocab_size: number of token ids.
    d_model: residual stream width D.
    n_layers: number of decoder blocks L.
    n_heads: query heads H.
    n_kv_heads: key/value heads K (grouped-query attention; H % K == 0).
    head_dim: per-head width hd (even: RoPE rotates pairs of halves).
    d_ff: SwiGLU hidden width F.
    rope_theta: RoPE base.
    rms_eps: RMSNorm epsilon.
    qk_norm: Qwen3 RMSNorm over head_dim of q and k, before RoPE.
    qkv_bias: Qwen2 biases on q/k/v projections.
    tie_embeddings: logits = h @ embedding.T (no lm_head kernel).
    max_seq_len: longest sequence the model is meant for (RoPE needs no table, so this is only
      checked, never allocated).
    rope_llama3_scaling: (factor, low_freq_factor, high_freq_factor,
      original_max_position_embeddings) as in Llama 3.x `rope_scaling`, or None.
    n_experts: routed experts E of every block's mixture-of-experts MLP (lowrl/models/moe.py);
      0 = the dense SwiGLU MLP of width d_ff (d_ff is then unused by the blocks).
    n_experts_per_tok: experts k each token is routed to (top-k of the router's softmax).
    moe_d_ff: hidden width of each routed expert (transformers' moe_intermediate_size).
    norm_topk_prob: renormalise the k selected probabilities to sum to 1 (Qwen3-MoE: true).
    shared_expert_d_ff: width of the Qwen2-MoE shared expert (gated by a sigmoid of its own
      D -> 1 projection); 0 = none (Qwen3-MoE).

  Execution knobs (how the forward runs, not what it computes; none changes the param tree):
    scan_layers: run the decoder blocks as `jax.lax.scan`s over their params stacked inside the
      jitted forward (one scan per run of consecutive layers with identical precision), so the
      compiled program does not grow with depth. Same numbers as unrolled, bit for bit.
    remat: per-layer rematerialisation in the backward: "none", "full" (jax.checkpoint saving
      only each layer's input) or "dots" (also saves the matmul outputs without batch dims).
    attention: "materialized" (one FP32 [B, K, G, T, S] score tensor per layer) or "chunked"
      (queries in chunks of `attention_chunk`, each with its exact softmax over all keys).
    attention_chunk: query rows per chunk of attention="chunked".
    logprob_chunk: vocabulary columns per chunk of the LM head + log-softmax in
      `token_logprobs(_and_entropy)` (online logsumexp, no [B, T, V] FP32 array); 0 = full.
  """

  vocab_size: int
  d_model: int
  n_layers: int
  n_heads: int
  n_kv_heads: int
  head_dim: int
  d_ff: int
  rope_theta: float = 10000.0
  rms_eps: float = 1e-6
  qk_norm: bool = False
  qkv_bias: bool = False
  tie_embeddings: bool = False
  max_seq_len: int = 2048
  rope_llama3_scaling: tuple[float, float, float, int] | None = None
  n_experts: int = 0
  n_experts_per_tok: int = 0
  moe_d_ff: int = 0
  norm_topk_prob: bool = False
  shared_expert_d_ff: int = 0
  scan_layers: bool = False
  remat: str = "none"
  attention: str = "materialized"
  attention_chunk: int = 512
  logprob_chunk: int = 0

  def __post_init__(self):
    for name in ("vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "head_dim", "d_ff",
                 "max_seq_len"):
      value = getattr(self, name)
      if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"ModelConfig.{name} must be a positive int, got {value!r}.")
    if not isinstance(self.scan_layers, bool):
      raise ValueError(f"ModelConfig.scan_layers must be a bool, got {self.scan_layers!r}.")
    if self.remat not in REMAT_MODES:
      raise ValueError(f"ModelConfig.remat={self.remat!r}; use one of {REMAT_MODES}.")
    if self.attention not in ATTENTION_MODES:
      raise ValueError(f"ModelConfig.attention={self.attention!r}; use one of {ATTENTION_MODES}.")
    for name, minimum in (("attention_chunk", 1), ("logprob_chunk", 0)):
      value = getattr(self, name)
      if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ValueError(f"ModelConfig.{name} must be an int >= {minimum}, got {value!r}.")
    for name in ("n_experts", "n_experts_per_tok", "moe_d_ff", "shared_expert_d_ff"):
      value = getattr(self, name)
      if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ValueError(f"ModelConfig.{name} must be an int >= 0, got {value!r}.")
    if self.n_experts and not (0 < self.n_experts_per_tok <= self.n_experts and self.moe_d_ff):
      raise ValueError(f"ModelConfig: n_experts={self.n_experts} needs 1 <= n_experts_per_tok "
                       f"<= n_experts (got {self.n_experts_per_tok}) and moe_d_ff > 0 (got "
                       f"{self.moe_d_ff}).")
    if not self.n_experts and (self.n_experts_per_tok or self.moe_d_ff or self.shared_expert_d_ff
                               or self.norm_topk_prob):
      raise ValueError("ModelConfig: n_experts_per_tok / moe_d_ff / shared_expert_d_ff / "
                       "norm_topk_prob describe a mixture-of-experts MLP; set n_experts > 0.")
    if self.n_heads % self.n_kv_heads:
      raise ValueError(f"n_heads={self.n_heads} is not a multiple of n_kv_heads={self.n_kv_heads}; "
                       "grouped-query attention shares each kv head among n_heads // n_kv_heads "
                       "query heads. Pick n_kv_heads dividing n_heads.")
    if self.head_dim % 2:
      raise ValueError(f"head_dim={self.head_dim} must be even (RoPE rotates two halves).")
    if not self.rope_theta > 0:
      raise ValueError(f"rope_theta must be > 0, got {self.rope_theta}.")
    if not self.rms_eps > 0:
      raise ValueError(f"rms_eps must be > 0, got {self.rms_eps}.")
    if self.rope_llama3_scaling is not None:
      if isinstance(self.rope_llama3_scaling, list):
        # Lists are unhashable; accept them from JSON/configs but store a tuple.
        object.__setattr__(self, "rope_llama3_scaling", tuple(self.rope_llama3_scaling))
      if len(self.rope_llama3_scaling) != 4:
        raise ValueError("rope_llama3_scaling must be (factor, low_freq_factor, high_freq_factor, "
                         f"original_max_position_embeddings), got {self.rope_llama3_scaling!r}.")
      factor, low, high, orig = self.rope_llama3_scaling
      if not (factor > 0 and low > 0 and high > low and orig > 0):
        raise ValueError("rope_llama3_scaling needs factor > 0, 0 < low_freq_factor < "
                         f"high_freq_factor and original_max_position_embeddings > 0; got "
                         f"{self.rope_llama3_scaling!r}.")

  @property
  def q_dim(self) -> int:
    """H * hd: width of the q projection output and o projection input."""
    return self.n_heads * self.head_dim

  @property
  def kv_dim(self) -> int:
    """K * hd: width of each of the k and v projection outputs."""
    return self.n_kv_heads * self.head_dim

  @property
  def is_moe(self) -> bool:
    """True when the blocks' MLPs are mixtures of experts."""
    return self.n_experts > 0

  def mlp_params(self, active: bool = False) -> int:
    """Parameters of one block's MLP; `active`: only those a token uses (k routed experts)."""
    d = self.d_model
    if not self.is_moe:
      return 3 * d * self.d_ff
    experts = self.n_experts_per_tok if active else self.n_experts
    shared = 3 * d * self.shared_expert_d_ff + (d if self.shared_expert_d_ff else 0)
    return d * self.n_experts + experts * 3 * d * self.moe_d_ff + shared

  def num_params(self, include_embedding: bool = True) -> int:
    """Number of parameters in the tree `init_params` builds."""
    d, v = self.d_model, self.vocab_size
    attn = d * self.q_dim + 2 * d * self.kv_dim + self.q_dim * d
    if self.qkv_bias:
      attn += self.q_dim + 2 * self.kv_dim
    if self.qk_norm:
      attn += 2 * self.head_dim
    per_layer = attn + self.mlp_params() + 2 * d
    total = self.n_layers * per_layer + d  # + final norm
    if include_embedding:
      total += v * d
    if not self.tie_embeddings:
      total += d * v
    return total


# Presets. `tiny` is for CPU tests, `small` the default of benchmarks and CPU experiments
# (~0.8M parameters with a 256-token vocabulary); the rest mirror public checkpoints' config.json.
_PRESETS: dict[str, ModelConfig] = {
    "tiny": ModelConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2,
                        head_dim=8, d_ff=64, max_seq_len=256),
    "small": ModelConfig(vocab_size=256, d_model=128, n_layers=4, n_heads=4, n_kv_heads=2,
                         head_dim=32, d_ff=384, tie_embeddings=True, max_seq_len=1024),
    "qwen3_0_6b": ModelConfig(vocab_size=151936, d_model=1024, n_layers=28, n_heads=16,
                              n_kv_heads=8, head_dim=128, d_ff=3072, rope_theta=1e6, rms_eps=1e-6,
                              qk_norm=True, tie_embeddings=True, max_seq_len=40960),
    # Qwen/Qwen3-1.7B config.json (hidden_size 2048, intermediate_size 6144, 28 layers, 16/8
    # heads, head_dim 128, tied embeddings).
    "qwen3_1_7b": ModelConfig(vocab_size=151936, d_model=2048, n_layers=28, n_heads=16,
                              n_kv_heads=8, head_dim=128, d_ff=6144, rope_theta=1e6, rms_eps=1e-6,
                              qk_norm=True, tie_embeddings=True, max_seq_len=40960),
    # Qwen/Qwen3-8B config.json (hidden_size 4096, intermediate_size 12288, 36 layers, 32/8
    # heads, head_dim 128, untied embeddings).
    "qwen3_8b": ModelConfig(vocab_size=151936, d_model=4096, n_layers=36, n_heads=32,
                            n_kv_heads=8, head_dim=128, d_ff=12288, rope_theta=1e6, rms_eps=1e-6,
                            qk_norm=True, tie_embeddings=False, max_seq_len=40960),
    # Qwen/Qwen3-30B-A3B config.json: 48 layers, 32/4 heads of 128, 128 experts of width 768,
    # top-8 renormalised, untied embeddings.
    "qwen3_30b_a3b": ModelConfig(vocab_size=151936, d_model=2048, n_layers=48, n_heads=32,
                                 n_kv_heads=4, head_dim=128, d_ff=6144, rope_theta=1e6,
                                 rms_eps=1e-6, qk_norm=True, tie_embeddings=False,
                                 max_seq_len=40960, n_experts=128, n_experts_per_tok=8,
                                 moe_d_ff=768, norm_topk_prob=True),
    "qwen2_5_0_5b": ModelConfig(vocab_size=151936, d_model=896, n_layers=24, n_heads=14,
                                n_kv_heads=2, head_dim=64, d_ff=4864, rope_theta=1e6,
                                rms_eps=1e-6, qkv_bias=True, tie_embeddings=True,
                                max_seq_len=32768),
    "llama3_2_1b": ModelConfig(vocab_size=128256, d_model=2048, n_layers=16, n_heads=32,
                               n_kv_heads=8, head_dim=64, d_ff=8192, rope_theta=500000.0,
                               rms_eps=1e-5, tie_embeddings=True, max_seq_len=131072,
                               rope_llama3_scaling=(32.0, 1.0, 4.0, 8192)),
}


def preset(name: str, **overrides) -> ModelConfig:
  """A named ModelConfig (`tiny`, `small`, `qwen3_0_6b`, ...), with optional field overrides."""
  if name not in _PRESETS:
    raise ValueError(f"Unknown model preset {name!r}; use one of {sorted(_PRESETS)}.")
  return dataclasses.replace(_PRESETS[name], **overrides)


def preset_names() -> tuple[str, ...]:
  return tuple(sorted(_PRESETS))
