r"""Export a training run's policy as a Hugging Face checkpoint.

  python -m experiments.export_hf --workdir=/tmp/lowrl_run --out=/tmp/policy_hf
  python -m experiments.export_hf --workdir=W --out=DIR --step=20 --dtype=bfloat16
  python -m experiments.export_hf --workdir=W --out=DIR --rollout_format=nvfp4   # ModelOpt NVFP4
  python -m experiments.export_hf --workdir=W --out=DIR --lora_format=peft  # a LoRA run's adapters

Writes config.json + model.safetensors (transformers' AutoModelForCausalLM loads them) from the
newest checkpoint in <workdir>/checkpoints (or --step), with the model config rebuilt from the
run's <workdir>/config.json by the loop's own `build`. When the run's tokenizer came from a
checkpoint (`model.hf_checkpoint` in the config), its tokenizer.json, tokenizer_config.json and
generation_config.json (and chat_template.jinja) are copied beside the weights (from a `.gguf`
file: written from its metadata, lowrl/checkpoints/gguf_tokenizer.py); the built-in
character tokenizer has no Hugging Face form and nothing is written for it (the log says so).

--rollout_format=nvfp4|nvfp4_w4a16|mxfp8 instead writes the block linears quantized in NVIDIA
ModelOpt's layout (lowrl/checkpoints/hf_quantized.py; vLLM: quantization="modelopt_fp4" /
"modelopt_mxfp8"; docs/export.md): with the run's sampler weight quantizers when its recipe
quantizes weights in that format (4/6, 16x16 blocks, unquantized tail layers listed in `ignore`,
fused q/k/v and gate/up with one shared global scale), so the file holds the sampler's weights bit
for bit, else with the format's default quantizer. NVFP4's static activation scales are calibrated
on the run's calibration batch (train prompts + reference answers) in the trainer's precision, as
the loop calibrates its sampler; nvfp4_w4a16 (ModelOpt "W4A16_NVFP4") has none.

A LoRA run (lora.rank > 0, docs/lora.md) is written merged, W + A B alpha / r (what PEFT's
merge_and_unload gives), in any of the formats above; --lora_format=peft writes its adapters alone
in PEFT's layout (adapter_config.json + adapter_model.safetensors, which PEFT and vLLM's LoRA
loader read on top of the base).

The export runs on the host CPU (JAX_PLATFORMS=cpu unless set): it restores only the `params`
subtree and needs no accelerator. Bad input (no checkpoint, unknown step, non-empty --out
without --overwrite) is one line on stderr and exit status 2.
"""
import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")  # before jax is imported: host-only work

import json  # noqa: E402
import shutil  # noqa: E402
from typing import Any, Callable  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import ml_collections  # noqa: E402
import numpy as np  # noqa: E402
import orbax.checkpoint as ocp  # noqa: E402
from absl import app, flags  # noqa: E402

from configs import base as base_config  # noqa: E402
from lowrl import user_cache  # noqa: E402
from lowrl.checkpoints import gguf, gguf_tokenizer, hf, hf_quantized, peft_adapters  # noqa: E402
from lowrl.models import calibration, init, layout, lora  # noqa: E402
from lowrl.training import base_store, exits, run_config  # noqa: E402
from lowrl.training.setup import Setup, build  # noqa: E402
from lowrl.training.trainer import Trainer  # noqa: E402
from lowrl.training.checkpointing import verify_manifest  # noqa: E402

# Files of a source checkpoint that describe its tokenizer and generation defaults.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "generation_config.json",
                   "special_tokens_map.json", "chat_template.jinja")
_DTYPES = {"": None, "float32": jnp.float32, "bfloat16": jnp.bfloat16}


class ExportError(ValueError):
  """Bad input to the export; the message names the fix."""


def _tuples(value: Any) -> Any:
  """JSON lists back to the tuples the configs hold (config.json cannot store tuples)."""
  if isinstance(value, dict):
    return {k: _tuples(v) for k, v in value.items()}
  if isinstance(value, list):
    return tuple(_tuples(v) for v in value)
  return value


def run_config_of(workdir: str) -> ml_collections.ConfigDict:
  """The config a run in `workdir` was started with (<workdir>/config.json)."""
  path = os.path.join(workdir, run_config.CONFIG_FILE)
  if not os.path.isfile(path):
    raise ExportError(f"{path} not found: --workdir must be a lowrl training run directory "
                      "(it holds config.json and checkpoints/).")
  with open(path) as f:
    try:
      saved = json.load(f)["config"]
    except (json.JSONDecodeError, KeyError, TypeError) as e:
      raise ExportError(f"{path} is not a lowrl run config ({e}).") from None
  return _with_new_knobs(ml_collections.ConfigDict(_tuples(saved)))


# Precision knobs added after runs were saved, with the value such a run was trained under.
_PRECISION_BEFORE = {"act_format": "", "weight_scales": "per_linear"}


def _with_new_knobs(saved: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
  """A saved run config with the knobs added since filled in: precision's with the behaviour the
  run had (`_PRECISION_BEFORE`: it quantized each linear with its own scale), the rest with the
  values of configs/base.py (knobs that don't change the weights)."""
  if "precision" in saved:
    for k, v in _PRECISION_BEFORE.items():
      if k not in saved.precision:
        saved.precision[k] = v
  out = base_config.get_config()
  out.precision = saved.precision

  def merge(dst, src):
    for k, v in src.items():
      if isinstance(v, ml_collections.ConfigDict) and k in dst and isinstance(
          dst[k], ml_collections.ConfigDict):
        merge(dst[k], v)
      else:
        dst[k] = v

  with out.unlocked():
    merge(out, saved)
  return out


def _source_checkpoint(cfg: ml_collections.ConfigDict) -> str | None:
  """The Hugging Face checkpoint the run started from, if its config names one."""
  model = cfg.get("model") or {}
  source = model.get("hf_checkpoint") if hasattr(model, "get") else None
  return source or None


def copy_tokenizer_files(source: str, out: str) -> list[str]:
  """Copies the TOKENIZER_FILES that `source` has into `out` (a `.gguf` source: writes them from
  its metadata); returns their names."""
  if gguf.is_gguf(source):
    return gguf_tokenizer.write_hf_tokenizer_files(source, out)
  copied = []
  for name in TOKENIZER_FILES:
    if os.path.isfile(os.path.join(source, name)):
      shutil.copyfile(os.path.join(source, name), os.path.join(out, name))
      copied.append(name)
  if "tokenizer.json" not in copied:
    raise ExportError(f"The run's source checkpoint {source} has no tokenizer.json to export; "
                      "restore it there.")
  return copied


def _restore_params(ckpt_dir: str, step: int | None, abstract_params: Any) -> tuple[Any, int]:
  """The `params` subtree of checkpoint `step` (None: the newest) on one device, read-only."""
  if not os.path.isdir(ckpt_dir):
    raise ExportError(f"No checkpoints in {ckpt_dir}: the run saved none yet (it saves every "
                      "checkpoint_every steps).")
  options = ocp.CheckpointManagerOptions(read_only=True, cleanup_tmp_directories=False,
                                         create=False, enable_async_checkpointing=False)
  with ocp.CheckpointManager(ckpt_dir, options=options,
                             item_handlers={"state": ocp.PyTreeCheckpointHandler()}) as manager:
    steps = sorted(manager.all_steps())
    if not steps:
      raise ExportError(f"No finished checkpoint in {ckpt_dir}; let the run save one first.")
    if step is None:
      step = steps[-1]
    elif step not in steps:
      raise ExportError(f"--step={step} is not among the checkpoints in {ckpt_dir}: {steps}.")
    problem = verify_manifest(os.path.join(ckpt_dir, str(step)))
    if problem is not None and not problem.startswith("no "):
      raise ExportError(f"Checkpoint step {step} in {ckpt_dir} is damaged ({problem}); export "
                        f"another --step (available: {steps}).")
    item = {"params": abstract_params}
    out = manager.restore(step, args=ocp.args.Composite(state=ocp.args.PyTreeRestore(
        item=item, restore_args=ocp.checkpoint_utils.construct_restore_args(item),
        partial_restore=True)))
  return out.state["params"], step


def _calibrated_amax(setup: Setup, params: Any) -> dict[str, jax.Array]:
  """max |input| of every block linear on the loop's calibration batch, trainer's precision."""
  trainer = Trainer(setup, log=lambda _: None)
  tokens, mask = np.asarray(trainer.calib_tokens), np.asarray(trainer.calib_mask)
  policy = setup.trainer_policy
  paths = tuple(m.full_path for m in layout.matmuls(setup.model_cfg) if m.layer is not None)
  key = policy.quant_key(jax.random.key(setup.loop.seed))
  return calibration.calibrate_act_amax(params, jnp.asarray(tokens), setup.model_cfg, policy,
                                        paths, mask_BT=jnp.asarray(mask), quant_key=key)


def export(workdir: str, out: str, *, step: int | None = None, rollout_format: str = "",
           dtype: Any = None, overwrite: bool = False, lora_format: str = "",
           log: Callable[[str], None] = print) -> dict[str, Any]:
  """Writes the policy of `workdir` at `step` (None: the newest checkpoint) to `out`.

  A LoRA run (lora.rank > 0) is written merged (W + A B alpha / r) unless `lora_format` is
  "peft": its adapters alone in PEFT's layout (lowrl/checkpoints/peft_adapters.py).

  Returns {"step", "out", "tokenizer_files", "rollout_format"}. Raises ExportError naming the fix.
  """
  if rollout_format and rollout_format not in hf_quantized.ROLLOUT_FORMATS:
    raise ExportError(f"--rollout_format={rollout_format!r}; use one of "
                      f"{hf_quantized.ROLLOUT_FORMATS} (or leave it empty).")
  if os.path.exists(out) and (not os.path.isdir(out) or (os.listdir(out) and not overwrite)):
    raise ExportError(f"--out={out} exists and is not an empty directory; pick another or pass "
                      "--overwrite.")
  cfg = run_config_of(workdir)
  # The export restores onto one device: the saved mesh shape may not fit this machine.
  cfg.mesh.shape = (-1,) + (1,) * (len(cfg.mesh.axes) - 1)
  try:
    setup = build(cfg)
  except ValueError as e:
    raise ExportError(f"The run's config does not build here: {e}") from None
  device = jax.local_devices()[0]
  shapes = init.param_shapes(setup.model_cfg)
  if setup.lora is not None:  # a LoRA run's checkpoints hold its adapters alone
    shapes = lora.adapter_shapes(setup.lora, setup.model_cfg)
  one = jax.sharding.SingleDeviceSharding(device)
  master = jnp.dtype(cfg.optimizer.master_dtype)  # the loop trains params in this dtype
  abstract = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, master, sharding=one), shapes)
  params, step = _restore_params(os.path.join(workdir, "checkpoints"), step, abstract)
  if setup.lora is not None:
    base = base_store.load_base(setup.base, setup.task, setup.model_cfg, setup.plan, workdir,
                                log=lambda _: None)  # the frozen base the adapters sit on
    params = lora.merge(jax.tree.map(lambda x: jax.device_put(x.astype(master), one), base),
                        params)
    if lora_format == "peft":
      os.makedirs(out, exist_ok=True)
      peft_adapters.save_adapters(out, params, setup.lora, setup.model_cfg,
                                  base_model_name_or_path=cfg.model.hf_checkpoint or None)
      log(f"[export] step {step} of {workdir}: LoRA adapters (r={setup.lora.rank}) in PEFT's "
          f"layout -> {out}")
      return {"step": step, "out": out, "tokenizer_files": [], "rollout_format": ""}
    # The merged model W + A B alpha / r, as PEFT's merge_and_unload writes it.
    params = lora.merged_kernels(params, setup.lora.scale)
  elif lora_format:
    raise ExportError(f"--lora_format={lora_format} needs a LoRA run (lora.rank > 0); this "
                      "run trained every weight: drop the flag.")

  source = _source_checkpoint(cfg)
  if (source and not gguf.is_gguf(source)
      and not os.path.isfile(os.path.join(source, "tokenizer.json"))):
    raise ExportError(f"The run's source checkpoint {source} has no tokenizer.json to export; "
                      "restore it there.")
  extra = hf.read_checkpoint_config(source) if source else None
  if rollout_format:  # checked before anything is written
    try:
      hf_quantized.export_policy(setup.model_cfg, rollout_format, setup.sampler_policy)
    except ValueError as e:
      raise ExportError(str(e)) from None
  os.makedirs(out, exist_ok=True)
  if rollout_format:
    amax = _calibrated_amax(setup, params) if rollout_format == "nvfp4" else None
    try:
      hf_quantized.save_quantized_checkpoint(out, setup.model_cfg, params, rollout_format,
                                             act_amax=amax, policy=setup.sampler_policy,
                                             dtype=dtype, extra_config=extra)
    except ValueError as e:
      raise ExportError(str(e)) from None
  else:
    hf.save_hf_checkpoint(out, setup.model_cfg, params, dtype=dtype, extra_config=extra)
  copied = []
  if source:
    copied = copy_tokenizer_files(source, out)
    log(f"[export] tokenizer files from {source}: {copied}")
  else:
    log("[export] the run used lowrl's built-in character tokenizer, which has no Hugging Face "
        "tokenizer files: none written (token ids are the CharTokenizer's).")
  log(f"[export] step {step} of {workdir} -> {out} ({setup.model_cfg.num_params():,} params"
      f"{', ModelOpt ' + rollout_format.upper() if rollout_format else ''})")
  return {"step": step, "out": out, "tokenizer_files": copied, "rollout_format": rollout_format}


_WORKDIR = flags.DEFINE_string("workdir", None, "The training run directory to export from.")
_OUT = flags.DEFINE_string("out", None, "Output directory of the Hugging Face checkpoint.")
_STEP = flags.DEFINE_integer("step", None, "Checkpoint step to export (default: the newest).")
_ROLLOUT = flags.DEFINE_enum("rollout_format", "", ["", *hf_quantized.ROLLOUT_FORMATS],
                             "Write the block linears quantized in ModelOpt's NVFP4 / "
                             "W4A16_NVFP4 / MXFP8 layout (empty: unquantized).")
_DTYPE = flags.DEFINE_enum("dtype", "", list(_DTYPES), "dtype of the written (unquantized) "
                           "tensors; empty keeps the run's parameter dtype.")
_COMPILE_CACHE = user_cache.define_compile_cache_flag()
_OVERWRITE = flags.DEFINE_bool("overwrite", False, "Write into a non-empty --out directory.")
_LORA_FORMAT = flags.DEFINE_enum("lora_format", "", ["", "peft"], "A LoRA run: empty writes the "
                                 "merged model; peft writes adapter_config.json + "
                                 "adapter_model.safetensors (the adapters alone).")


def _fail(msg: str) -> None:
  exits.exit_with_line(f"export_hf: error: {msg}", exits.USAGE)


def main(argv):
  if len(argv) > 1:
    _fail(f"unexpected arguments {argv[1:]}; flags look like --workdir=DIR.")
  if not _WORKDIR.value or not _OUT.value:
    _fail("--workdir and --out are required.")
  user_cache.enable_compile_cache()
  try:
    export(_WORKDIR.value, _OUT.value, step=_STEP.value, rollout_format=_ROLLOUT.value,
           dtype=_DTYPES[_DTYPE.value], overwrite=_OVERWRITE.value,
           lora_format=_LORA_FORMAT.value, log=lambda s: print(s, flush=True))
  except (ExportError, FileNotFoundError) as e:
    _fail(str(e).splitlines()[0] if str(e) else type(e).__name__)


def run_main():
  app.run(main)


if __name__ == "__main__":
  run_main()
