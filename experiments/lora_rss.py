r"""Measured peak resident memory (CPU) of a training process: full fine-tuning vs LoRA on a
packed NVFP4 base, same model, same RL steps.

  python -m experiments.lora_rss [--d_model=768 --d_ff=3072 --n_layers=6 --steps=2]

Each mode runs in a fresh subprocess (one at a time) that builds the main job's trainer
(configs/base.py under the NVFP4 recipe, 1-digit addition, the model widened to the flags'
shape), initialises the state as the loop does (params, optimizer state, a reference copy), and
runs `--steps` RL steps (rollout + update, the sampler's weight sync included); it reports
`resource.getrusage(RUSAGE_SELF).ru_maxrss`. Modes: `idle` (the same process up to the build,
no state: the interpreter, JAX and the compiled programs' share is not in it), `full_fp32`
(FP32 master weights + FP32 Adam), `full_bf16` (BF16 master weights), `lora_bf16`
(LoRA r=16 on every block linear, base frozen in the master dtype BF16), `lora_nvfp4` (the same,
base held packed: --config.lora.packed_base). Prints one table: peak RSS, peak minus idle, and the
ratios full / lora of both. Host memory on a shared machine: run it alone.
"""
import json
import os
import resource
import subprocess
import sys

from absl import app, flags

_D = flags.DEFINE_integer("d_model", 768, "model width")
_F = flags.DEFINE_integer("d_ff", 3072, "MLP width")
_L = flags.DEFINE_integer("n_layers", 6, "layers")
_STEPS = flags.DEFINE_integer("steps", 2, "RL steps per process")
_CHILD = flags.DEFINE_string("child", "", "internal: run one mode in this process")
MODES = ("idle", "full_fp32", "full_bf16", "lora_bf16", "lora_nvfp4")
_MODES = flags.DEFINE_list("modes", list(MODES), "modes to run (idle first)")


def _config(mode: str):
  from configs import base
  c = base.get_config("nvfp4_recipe")
  c.task.name = "addition"
  c.task.kwargs = {"num_digits": 1}
  c.model.update(dict(d_model=_D.value, d_ff=_F.value, n_layers=_L.value, n_heads=8,
                      n_kv_heads=4, head_dim=_D.value // 8, scan_layers=True, remat="full"))
  c.rl.update(dict(num_prompts=4, group_size=4, max_new_tokens=4, steps=_STEPS.value))
  c.mesh.rules = ()
  c.hardware = "none"
  if mode in ("full_bf16", "lora_bf16", "lora_nvfp4"):
    c.optimizer.master_dtype = "bfloat16"
  if mode.startswith("lora"):
    c.lora.update(dict(rank=16, alpha=32.0, packed_base=mode == "lora_nvfp4"))
  return c


def child(mode: str) -> dict:
  import jax
  from lowrl.models import init
  from lowrl.training import optimizer, storage
  from lowrl.training.setup import build
  from lowrl.training.trainer import Trainer
  setup = build(_config(mode))
  trainer = Trainer(setup, log=lambda _: None)
  out = {"mode": mode, "params": setup.model_cfg.num_params()}
  if mode != "idle":
    base = init.init_params(setup.model_cfg, jax.random.key(0))
    params = trainer.place(optimizer.to_master(trainer.with_adapters(base),
                                               setup.loop.master_dtype))
    del base
    opt = trainer.init_opt_state(params)
    ref = storage.keep(params, setup.loop.ref_storage)
    for step in range(_STEPS.value):
      sampler = jax.tree.map(lambda x: x.copy(), params)
      params, opt, m, _ = trainer.rl_step(sampler, params, opt, ref, step,
                                          jax.random.key(step), stale=False,
                                          sampler_version=step)
      jax.block_until_ready(params)
    out["loss_finite"] = bool(jax.numpy.isfinite(m["loss"]))
  out["peak_rss_kib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
  return out


def main(_):
  if _CHILD.value:
    print("RESULT " + json.dumps(child(_CHILD.value)), flush=True)
    return
  rows = {}
  modes = [m for m in MODES if m in _MODES.value]
  for mode in modes:
    args = [sys.executable, "-m", "experiments.lora_rss", f"--child={mode}",
            f"--d_model={_D.value}", f"--d_ff={_F.value}", f"--n_layers={_L.value}",
            f"--steps={_STEPS.value}"]
    res = subprocess.run(args, capture_output=True, text=True, env=os.environ)
    line = [ln for ln in res.stdout.splitlines() if ln.startswith("RESULT ")]
    if res.returncode or not line:
      print(res.stderr[-3000:])
      raise SystemExit(f"{mode} failed (rc {res.returncode})")
    rows[mode] = json.loads(line[0][len("RESULT "):])
    print(json.dumps(rows[mode]), flush=True)
  idle = rows["idle"]["peak_rss_kib"]
  gib = lambda kib: kib / 2 ** 20  # noqa: E731
  print(f"\nmodel: {rows['idle']['params']:,} params (d_model={_D.value}, d_ff={_F.value}, "
        f"{_L.value} layers); {_STEPS.value} RL steps per process")
  print(f"{'mode':<12}{'peak RSS GiB':>14}{'minus idle GiB':>16}")
  for mode in modes:
    kib = rows[mode]["peak_rss_kib"]
    print(f"{mode:<12}{gib(kib):>14.3f}{gib(kib - idle):>16.3f}")
  for full in [m for m in ("full_fp32", "full_bf16") if m in rows]:
    for lo in [m for m in ("lora_bf16", "lora_nvfp4") if m in rows]:
      a, b = rows[full]["peak_rss_kib"], rows[lo]["peak_rss_kib"]
      print(f"{full} / {lo}: {a / b:.2f} (peak), {(a - idle) / (b - idle):.2f} (minus idle)")


if __name__ == "__main__":
  app.run(main)
