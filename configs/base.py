"""Base config of the RL pipeline: mid-train a tiny base on a verifiable task, then GRPO.

Everything a run needs is here; recipe files (`configs/<recipe>.py`) override `precision` only.
Override from the command line: `--config.rl.steps=100 --config.precision.bf16_last_fraction=0`.
"""
import ml_collections

from lowrl import precision, sharding


def get_config(recipe: str = "nvfp4_recipe") -> ml_collections.ConfigDict:
  c = ml_collections.ConfigDict()
  c.seed = 0
  c.recipe = recipe

  c.task = ml_collections.ConfigDict()
  # Sorting 3-6 letters: a mid-trained base makes sampling errors RL can remove, and the problem
  # space is large enough that held-out problems measure skill, not memory (2-digit addition's
  # ~12k problems get memorised: RL then raises train reward but not held-out pass@1).
  c.task.name = "sorting"
  c.task.kwargs = ml_collections.ConfigDict({})

  # ~0.8M parameters: a forward+backward on 512x48 tokens is ~2 s on 2 CPU cores.
  c.model = ml_collections.ConfigDict()
  c.model.d_model = 128
  c.model.n_layers = 4
  c.model.n_heads = 4
  c.model.n_kv_heads = 2
  c.model.head_dim = 32
  c.model.d_ff = 384
  c.model.rope_theta = 10000.0
  c.model.qk_norm = False
  c.model.tie_embeddings = True

  # Trainer precision; the sampler uses the same recipe unless `sampler_precision.recipe` is set.
  c.precision = precision.recipe(recipe)
  c.sampler_precision = ml_collections.ConfigDict()
  c.sampler_precision.recipe = ""  # "" = same as the trainer
  c.sampler_exact = True  # sampler logprobs from the trainer's forward (bit-identical when same recipe)

  # Supervised mid-training of the base (BF16 compute, FP32 master weights).
  c.sft = ml_collections.ConfigDict()
  c.sft.steps = 150
  c.sft.batch_size = 128
  c.sft.lr = 3e-3
  c.sft.warmup_steps = 20
  c.sft.base_dir = ""  # "" = <workdir>/base; point several runs at one dir to share the base

  c.rl = ml_collections.ConfigDict()
  c.rl.steps = 40
  c.rl.num_prompts = 32
  c.rl.group_size = 8
  c.rl.max_new_tokens = 8
  c.rl.temperature = 1.0
  c.rl.top_k = 0  # 0 = off
  c.rl.top_p = 1.0
  c.rl.advantage = "grpo"  # grpo | drgrpo | rloo
  c.rl.loss = "grpo"  # grpo | dapo | gspo | cispo
  # "" = the loss's paper default (token_mean for dapo/cispo, seq_mean_token_mean for grpo/gspo);
  # or seq_mean_token_mean | token_mean | seq_mean_token_sum_norm (Dr.GRPO).
  c.rl.aggregation = ""
  c.rl.clip_eps_low = 0.2
  c.rl.clip_eps_high = ml_collections.config_dict.placeholder(float)  # None = 0.28 dapo, else 0.2
  c.rl.cispo_eps_max = 4.0
  c.rl.mu = 1  # inner updates per batch against pi_old
  c.rl.num_minibatches = 1
  c.rl.old_logp_source = "trainer"  # trainer (recompute) | sampler (recorded)
  c.rl.kl_coef = 0.0
  c.rl.kl_estimator = "k3"
  c.rl.ref_reset_every = 0  # 0 = never reset pi_ref
  c.rl.log_kl_ref = True  # keep pi_ref (the base) to log KL(pi || pi_ref) even when kl_coef = 0
  c.rl.dynamic_sampling = False  # DAPO: drop groups with identical rewards
  c.rl.overlong_buffer = 0  # DAPO overlong penalty ramp length (0 = off)
  c.rl.correction = "none"  # none | tis | mis
  c.rl.correction_level = "token"  # token | sequence
  c.rl.tis_cap = 2.0
  c.rl.mis_low = 0.5
  c.rl.mis_high = 5.0

  c.optimizer = ml_collections.ConfigDict()
  # RL moves a mid-trained base: with Adam, 1e-3 random-walks it away (reward falls); 1e-4..3e-4 is stable.
  c.optimizer.lr = 2e-4
  c.optimizer.schedule = "constant"
  c.optimizer.warmup_steps = 0
  c.optimizer.final_lr_fraction = 0.0
  c.optimizer.b1 = 0.9
  c.optimizer.b2 = 0.99
  c.optimizer.eps = 1e-8
  c.optimizer.weight_decay = 0.0
  c.optimizer.grad_clip = 1.0
  c.optimizer.master_dtype = "float32"  # float32 | bfloat16
  c.optimizer.master_rounding = "nearest"  # nearest | stochastic (bfloat16 master only)

  c.eval_num_prompts = 256
  c.eval_samples = 4  # samples per eval prompt for pass@1 at the rollout temperature
  c.eval_every = 0  # 0 = only at the start and the end
  c.log_every = 1
  c.checkpoint_every = 10
  c.num_text_samples = 4

  # Simulated asynchrony (lowrl.asyncrl.schedule): lag 0 and sync every step = synchronous RL.
  c.async_rl = ml_collections.ConfigDict()
  c.async_rl.lag = 0
  c.async_rl.sync_every = 1
  c.async_rl.lag_distribution = "fixed"  # fixed | uniform | geometric

  # Device mesh over every process's devices (lowrl/sharding.py): "data" splits the batch and
  # shards parameters FSDP-style, "model" is Megatron tensor parallelism; -1 fills the rest.
  # E.g. 8 GPUs as 4-way FSDP x 2-way TP: --config.mesh.shape="(-1, 2)".
  c.mesh = ml_collections.ConfigDict()
  c.mesh.shape = (-1, 1)
  c.mesh.axes = ("data", "model")
  c.mesh.batch_axes = ("data",)  # mesh axes the batch (rollouts, KV cache) is split over
  # (regex over parameter paths, partition spec); first fullmatch wins, unmatched = replicated.
  c.mesh.rules = sharding.DEFAULT_RULES
  c.mesh.strict = False  # True: a rule axis not dividing its dim is an error (else: replicated)
  return c
