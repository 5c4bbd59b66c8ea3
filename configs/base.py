"""Base config of the RL pipeline: mid-train a tiny base on a verifiable task, then GRPO.

Every value the main job runs is below, with a short comment; `--print_config` lists them all
with their full meanings (lowrl.training.schema.TRAIN, which also checks them: choices, ranges,
relations, one-line errors naming the flag). The precision section is a named recipe
(lowrl/recipes.py). Choose the recipe with the config file (`--config=configs/bf16.py`, or
`--config=configs/base.py:bf16`); override a knob from the command line:
`--config.rl.steps=100 --config.precision.bf16_last_fraction=0`. A new knob is one line here
plus its meaning (and check) in lowrl/training/schema.py.

The experiment the defaults describe: sorting 3-6 letters (a mid-trained base makes sampling errors
RL can remove, and the problem space is large enough that held-out problems measure skill, not
memory: 2-digit addition's ~12k problems get memorised, and RL then raises train reward but not
held-out pass@1) with a ~0.8M-parameter decoder, 50 SFT steps, then 40 RL steps of 32 prompts x 8
completions at Adam lr 2e-4 (RL moves a mid-trained base: 1e-3 random-walks it away and the reward
falls; 1e-4..4e-4 is stable).
"""
from __future__ import annotations

import ml_collections
from ml_collections.config_dict import placeholder

from lowrl import precision, sharding
from lowrl.models import lora


def get_config(recipe: str = "nvfp4_recipe") -> ml_collections.ConfigDict:
  """The main job's config under the precision `recipe` (a name of lowrl/recipes.py)."""
  c = ml_collections.ConfigDict()
  c.seed = 0  # init, data order, sampling and the held-out eval set

  c.task = ml_collections.ConfigDict()
  c.task.name = "sorting"  # lowrl.tasks.registry name; jsonl = a file of prompts and answers
  c.task.path = ""  # task.name=jsonl: the JSONL file
  c.task.verifier = ""  # task.name=jsonl: '' = exact match; numeric, boxed, ...
  c.task.chat_template = False  # task.name=jsonl + hf_checkpoint: prompts in its chat template
  c.task.kwargs = ml_collections.ConfigDict({})  # other task arguments, e.g. {'num_digits': 1}

  c.model = ml_collections.ConfigDict()
  c.model.hf_checkpoint = ""  # '' = the tiny decoder below; else a HF Llama/Qwen directory
  c.model.param_dtype = "float32"  # dtype the hf_checkpoint params are loaded in
  c.model.eos_token = ""  # '' = the hf_checkpoint's eos tokens; else the one token ending completions
  # The tiny decoder (~0.8M parameters): a forward+backward on 512x48 tokens is ~2 s on 2 cores.
  c.model.d_model = 128  # width
  c.model.n_layers = 4  # decoder layers
  c.model.n_heads = 4  # query heads
  c.model.n_kv_heads = 2  # key/value heads (GQA)
  c.model.head_dim = 32  # per-head width
  c.model.d_ff = 384  # SwiGLU hidden width
  c.model.rope_theta = 10000.0  # RoPE base
  c.model.qk_norm = False  # Qwen3 q/k RMSNorm
  c.model.tie_embeddings = True  # LM head = embedding transpose
  c.model.n_experts = 0  # routed experts per block; 0 = dense MLP
  c.model.n_experts_per_tok = 0  # top-k experts per token
  c.model.moe_d_ff = 0  # routed expert width
  c.model.norm_topk_prob = False  # renormalise the top-k router probabilities
  c.model.shared_expert_d_ff = 0  # Qwen2-MoE shared expert width; 0 = none
  # How the forward runs (memory, compile size); none changes a number.
  c.model.scan_layers = placeholder(bool)  # layers as lax.scans; None = on with hf_checkpoint
  c.model.remat = "none"  # per-layer rematerialisation: none | full | dots
  c.model.attention = "materialized"  # materialized | chunked
  c.model.attention_chunk = 512  # query rows per chunk of attention=chunked
  c.model.logprob_chunk = 0  # vocabulary chunk of the LM head + log-softmax; 0 = whole

  c.precision = precision.recipe(recipe)  # the trainer's recipe (and the sampler's)
  c.sampler_precision = ml_collections.ConfigDict()
  c.sampler_precision.recipe = ""  # the sampler's recipe; '' = the trainer's
  c.sampler_precision.kv_cache = "none"  # the sampler's KV cache format; none = compute dtype
  c.sampler_exact = True  # sampler logprobs from the trainer's forward
  c.refit_check_every = 1  # weight syncs between sampler-weight checks; 0 = off
  c.sampler_decode_min_rows = 16  # decode compaction's smallest bucket (rows per shard); 0 = off
  c.sampler_decode_buckets_per_halving = 1  # compaction buckets per halving of the rows

  c.lora = ml_collections.ConfigDict()  # LoRA adapters on a frozen base (docs/lora.md)
  c.lora.rank = 0  # adapter rank r; 0 = off (full fine-tuning)
  c.lora.alpha = 16.0  # the adapter's output is scaled by alpha / rank
  c.lora.targets = lora.ALL_LINEAR  # regex (fullmatch) over matmul paths that get adapters
  c.lora.dtype = "float32"  # the adapter products' operands: float32 | bfloat16
  c.lora.packed_base = False  # the trainer holds the base's quantized kernels packed
  c.lora.aqn_sigma_start = 0.0  # QeRL's adaptive quantization noise in the RMSNorms; 0 = off
  c.lora.aqn_sigma_end = 5e-4  # the noise scale of the last stage
  c.lora.aqn_stages = 10  # intervals of the run; the first without noise

  c.sft = ml_collections.ConfigDict()  # supervised mid-training of the base
  c.sft.steps = 50  # 0 = RL from the init (or the hf_checkpoint); 50 leaves RL room
  c.sft.batch_size = 128  # sequences per step
  c.sft.lr = 3e-3  # Adam learning rate
  c.sft.warmup_steps = 20  # linear warmup steps
  c.sft.base_dir = ""  # store of bases; '' = the shared user cache, 'none' = the workdir
  c.sft.seed = -1  # seed of the base; -1 = the run's seed
  c.sft.outlier_channels = 0  # outlier channels planted in the loaded base; 0 = none
  c.sft.outlier_gain = 1.0  # their gain (norm gain x g, reading kernel rows / g)

  c.rl = ml_collections.ConfigDict()
  c.rl.steps = 40  # RL steps (one sampled batch and its update each)
  c.rl.num_prompts = 32  # prompts per step
  c.rl.group_size = 8  # completions per prompt (the advantage group)
  c.rl.advantage = "grpo"  # group-relative advantage
  c.rl.std_ddof = 0  # group std: 0 population (GRPO paper), 1 sample
  c.rl.loss = "grpo"  # policy loss
  c.rl.aggregation = ""  # token aggregation; '' = the loss's paper default
  c.rl.clip_eps_low = 0.2  # PPO clip: ratio >= 1 - clip_eps_low
  c.rl.clip_eps_high = placeholder(float)  # ratio <= 1 + clip_eps_high; None = 0.28 dapo, else 0.2
  c.rl.cispo_eps_max = 4.0  # CISPO weight cap
  c.rl.mu = 1  # inner updates per batch against pi_old
  c.rl.num_minibatches = 1  # PPO minibatches per pass over the batch
  c.rl.micro_batches = 1  # gradient accumulation per minibatch; 1 = off
  c.rl.pack_tokens = 0  # packed update/scoring: tokens per packed row; 0 = padded rows
  c.rl.pack_rows = 1  # packed rows per data shard in one micro-batch
  c.rl.old_logp_source = "trainer"  # pi_old: trainer (recomputed) | sampler (recorded)
  c.rl.kl_coef = 0.0  # beta of the KL-to-reference penalty; 0 = none
  c.rl.kl_estimator = "k3"  # KL estimator
  c.rl.correction = "none"  # sampler/trainer mismatch correction: none | tis | mis | icepop | vcpo
  c.rl.correction_level = "token"  # correction weight per token | sequence
  c.rl.tis_cap = 2.0  # TIS truncation cap
  c.rl.mis_low = 0.5  # MIS: weights below are masked
  c.rl.mis_high = 5.0  # MIS: weights above are masked
  c.rl.max_new_tokens = 8  # completion budget in tokens
  c.rl.temperature = 1.0  # rollout temperature
  c.rl.top_k = 0  # top-k sampling; 0 = off
  c.rl.top_p = 1.0  # nucleus sampling; 1 = off
  c.rl.routing_replay = False  # MoE: the trainer reuses the sampler's expert choices (R3)
  c.rl.ref_reset_every = 0  # steps between pi_ref resets; 0 = never
  c.rl.log_kl_ref = True  # keep pi_ref to log KL(pi || pi_ref) even when kl_coef = 0
  c.rl.ref_storage = "param"  # where pi_ref's params live: param | bfloat16 | host
  c.rl.dynamic_sampling = False  # DAPO: drop groups with identical rewards
  c.rl.overlong_buffer = 0  # DAPO overlong penalty ramp in tokens; 0 = off

  c.optimizer = ml_collections.ConfigDict()
  c.optimizer.lr = 2e-4  # AdamW peak learning rate
  c.optimizer.schedule = "constant"  # schedule after warmup
  c.optimizer.warmup_steps = 0  # linear warmup, optimizer steps
  c.optimizer.final_lr_fraction = 0.0  # cosine/linear: final lr / lr
  c.optimizer.b1 = 0.9  # Adam first-moment decay
  c.optimizer.b2 = 0.99  # Adam second-moment decay
  c.optimizer.eps = 1e-8  # Adam epsilon
  c.optimizer.weight_decay = 0.0  # decoupled weight decay
  c.optimizer.grad_clip = 1.0  # global gradient-norm clip; None = off
  c.optimizer.master_dtype = "float32"  # master-weight dtype
  c.optimizer.master_rounding = "nearest"  # rounding of BF16 master weights
  c.optimizer.loss_scale = 1.0  # static loss scale (FP16 compute: e.g. 1024); 1 = off
  c.optimizer.compute_cast_rounding = "nearest"  # FP32 -> BF16 weight cast: nearest | stochastic

  c.eval_num_prompts = 256  # held-out eval prompts
  c.eval_samples = 4  # samples per eval prompt (pass@1)
  c.eval_every = 10  # steps between held-out evaluations; 0 = at the start and the end only
  c.log_every = 1  # steps between TensorBoard / metrics.jsonl points
  c.checkpoint_every = 10  # steps between checkpoints (the newest 2 are kept)
  c.checkpoint_keep_fractions = ()  # fractions of rl.steps whose checkpoints are kept too
  c.num_text_samples = 4  # sample completions in TensorBoard per logged step
  # The RL update and re-score compiled on a background thread while the base trains: off, as
  # on 2 busy cores it saved no wall time (docs/benchmarks.md, "Compiling ahead").
  c.precompile = False
  c.max_skipped_steps = 3  # consecutive skipped (non-finite) updates before the run stops

  c.diagnostics = ml_collections.ConfigDict()
  c.diagnostics.every = 0  # steps between gradient-bias / update-erasure probes; 0 = off
  c.diagnostics.code_churn = False  # log the fraction of quantized weight codes each step changes

  c.async_rl = ml_collections.ConfigDict()
  c.async_rl.lag = 0  # sampler version = trainer version - lag; 0 = synchronous
  c.async_rl.sync_every = 1  # steps between weight syncs to the sampler
  c.async_rl.lag_distribution = "fixed"  # lag draws
  c.async_rl.version_storage = "param"  # where the stale sampler's versions live

  c.mesh = ml_collections.ConfigDict()
  c.mesh.shape = (-1, 1)  # devices per mesh axis; -1 = the remaining devices
  c.mesh.axes = ("data", "model")  # data: batch + FSDP, model: tensor parallel
  c.mesh.batch_axes = ("data",)  # mesh axes the batch is split over
  c.mesh.rules = sharding.DEFAULT_RULES  # (parameter-path regex, partition spec) rules
  c.mesh.strict = False  # True: a rule axis that does not divide its dim is an error

  c.hardware = "auto"  # memory budget the estimate must fit: auto | none | a preset
  return c
