"""Base config of the RL pipeline: mid-train a tiny base on a verifiable task, then GRPO.

Everything a run needs is here; recipe files (`configs/<recipe>.py`) override `precision` only.
Override from the command line: `--config.rl.steps=100 --config.precision.bf16_last_fraction=0`;
choose the recipe with the config file (`--config=configs/bf16.py`, or
`--config=configs/base.py:bf16`). `--print_config` lists every knob.
"""
import ml_collections

from lowrl import precision, sharding
from lowrl.training import optimizer, rl_update


def get_config(recipe: str = "nvfp4_recipe") -> ml_collections.ConfigDict:
  c = ml_collections.ConfigDict()
  c.seed = 0  # seeds init, data order, sampling and the held-out eval set

  c.task = ml_collections.ConfigDict()
  # Sorting 3-6 letters: a mid-trained base makes sampling errors RL can remove, and the problem
  # space is large enough that held-out problems measure skill, not memory (2-digit addition's
  # ~12k problems get memorised: RL then raises train reward but not held-out pass@1).
  c.task.name = "sorting"
  # task.name=jsonl only: the JSONL file and its verifier (lowrl/tasks/jsonl.py, verifiers.py).
  c.task.path = ""
  c.task.verifier = ""  # "" = exact; numeric, boxed, ... (lowrl.tasks.verifiers)
  # Other constructor arguments of the task (e.g. {"num_digits": 1} for addition); set them in a
  # config file: the command line can only override keys that exist.
  c.task.kwargs = ml_collections.ConfigDict({})

  # ~0.8M parameters: a forward+backward on 512x48 tokens is ~2 s on 2 CPU cores.
  c.model = ml_collections.ConfigDict()
  c.model.d_model = 128  # model width
  c.model.n_layers = 4  # decoder layers
  c.model.n_heads = 4  # attention (query) heads
  c.model.n_kv_heads = 2  # key/value heads (GQA; divides n_heads)
  c.model.head_dim = 32  # per-head width
  c.model.d_ff = 384  # SwiGLU hidden width
  c.model.rope_theta = 10000.0  # rotary embedding base
  c.model.qk_norm = False  # RMSNorm on q and k per head (Qwen3)
  c.model.tie_embeddings = True  # LM head = embedding transpose
  c.model.scan_layers = False  # layers as lax.scans (compile size independent of depth; same bits)
  c.model.remat = "none"  # per-layer rematerialisation: none | full | dots
  c.model.attention = "materialized"  # materialized | chunked (attention_chunk query rows at a time)
  c.model.attention_chunk = 512  # query rows per chunk of attention=chunked
  c.model.logprob_chunk = 0  # vocabulary chunk of the LM head + log-softmax (0 = full [B, T, V])

  # Trainer precision; the sampler uses the same recipe unless `sampler_precision.recipe` is set.
  c.precision = precision.recipe(recipe)
  c.sampler_precision = ml_collections.ConfigDict()
  c.sampler_precision.recipe = ""  # "" = same as the trainer
  c.sampler_exact = True  # sampler logprobs from the trainer's forward (bit-identical when same recipe)

  # Supervised mid-training of the base (BF16 compute, FP32 master weights).
  c.sft = ml_collections.ConfigDict()
  c.sft.steps = 150  # supervised mid-training steps of the base (0 = RL from the random/loaded init)
  c.sft.batch_size = 128  # SFT sequences per step
  c.sft.lr = 3e-3  # SFT Adam learning rate
  c.sft.warmup_steps = 20  # SFT linear warmup steps
  c.sft.base_dir = ""  # "" = <workdir>/base; point several runs at one dir to share the base

  # Losses, advantages, corrections: lowrl.training.rl_update.default_rl_config (shared with the
  # simulator); the rest is specific to this loop.
  c.rl = rl_update.default_rl_config()
  c.rl.steps = 40  # RL steps (one sampled batch and its update each)
  c.rl.num_prompts = 32  # prompts per step
  c.rl.group_size = 8  # completions per prompt (the advantage group)
  c.rl.max_new_tokens = 8  # completion budget in tokens
  c.rl.temperature = 1.0  # rollout temperature (> 0)
  c.rl.top_k = 0  # 0 = off
  c.rl.top_p = 1.0  # nucleus sampling in (0, 1]; 1 = off
  c.rl.ref_reset_every = 0  # 0 = never reset pi_ref
  c.rl.log_kl_ref = True  # keep pi_ref (the base) to log KL(pi || pi_ref) even when kl_coef = 0
  c.rl.dynamic_sampling = False  # DAPO: drop groups with identical rewards
  c.rl.overlong_buffer = 0  # DAPO overlong penalty ramp length (0 = off)

  c.optimizer = optimizer.default_optimizer_config()
  # RL moves a mid-trained base: with Adam, 1e-3 random-walks it away (reward falls);
  # 1e-4..4e-4 is stable.
  c.optimizer.lr = 2e-4

  c.eval_num_prompts = 256  # held-out eval-split prompts
  c.eval_samples = 4  # samples per eval prompt for pass@1 at the rollout temperature
  c.eval_every = 0  # 0 = only at the start and the end
  c.log_every = 1  # steps between TensorBoard / metrics.jsonl points
  c.checkpoint_every = 10  # steps between checkpoints (the newest 2 intact ones are kept)
  c.num_text_samples = 4  # sample completions shown in TensorBoard per logged step
  # Stop (with an error naming the last good checkpoint) after this many consecutive RL steps
  # with a skipped optimizer update (non-finite loss, gradient or new parameters).
  c.max_skipped_steps = 3

  # Simulated asynchrony (lowrl.training.schedule): lag 0 and sync every step = synchronous RL.
  c.async_rl = ml_collections.ConfigDict()
  c.async_rl.lag = 0  # sampler version = trainer version - lag (>= 0)
  c.async_rl.sync_every = 1  # steps between weight syncs to the sampler
  c.async_rl.lag_distribution = "fixed"  # fixed | uniform | geometric

  # Device mesh over every process's devices (lowrl/sharding.py): "data" splits the batch and
  # shards parameters FSDP-style, "model" is Megatron tensor parallelism; -1 fills the rest.
  # E.g. 8 GPUs as 4-way FSDP x 2-way TP: --config.mesh.shape="(-1, 2)".
  c.mesh = ml_collections.ConfigDict()
  c.mesh.shape = (-1, 1)  # devices per mesh axis; -1 = the remaining devices
  c.mesh.axes = ("data", "model")  # mesh axis names (data: batch + FSDP, model: tensor parallel)
  c.mesh.batch_axes = ("data",)  # mesh axes the batch (rollouts, KV cache) is split over
  # (regex over parameter paths, partition spec); first fullmatch wins, unmatched = replicated.
  c.mesh.rules = sharding.DEFAULT_RULES
  c.mesh.strict = False  # True: a rule axis not dividing its dim is an error (else: replicated)
  return c
