"""Token batches for sampling (prompts) and supervised mid-training (prompt + target).

Layout, one row per example, right-padded to a fixed width so jitted consumers see one shape:

  prompts:  [bos, p_1 .. p_m, pad .. pad]                  lens_B = 1 + m (real tokens)
  sft:      [bos, p_1 .. p_m, t_1 .. t_r, eos, pad .. pad]  loss_mask_BT = 1 on t_1 .. t_r, eos

Both build the prompt part with the same function, so tokens_BT[b, :lens_B[b]] of the prompt
batch equals the first lens_B[b] tokens of the SFT row: a model sampled from a prompt sees
exactly the prefix it was supervised on. Prompt and target are tokenized separately (matters
only for subword tokenizers), which is also how sampled completions are tokenized. Without a bos
(a tokenizer whose bos_id is None) nothing is prepended.

loss_mask_BT[b, t] marks the *token* at t as a training target: with logits at t predicting
token t + 1, use loss_mask_BT[:, 1:] for the predictions logits[:, :-1]. The mask is float32
(data conventions in ARCHITECTURE.md); tokens are int32 numpy arrays.
"""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from lowrl.tasks.tokenizer import Tokenizer


def _check_max_len(max_len: int) -> None:
  if not isinstance(max_len, (int, np.integer)) or isinstance(max_len, bool) or max_len < 1:
    raise ValueError(f"max_len={max_len!r}; pass a positive integer width (e.g. task.max_prompt_len).")


def prompt_ids(tokenizer: Tokenizer, prompt: str) -> list[int]:
  """The token ids a prompt occupies in every batch: bos (if the tokenizer has one), then the prompt."""
  bos = [] if tokenizer.bos_id is None else [tokenizer.bos_id]
  return bos + tokenizer.encode(prompt)


def encode_prompts(tokenizer: Tokenizer, prompts: Sequence[str],
                   max_len: int) -> tuple[np.ndarray, np.ndarray]:
  """Right-padded prompt batch.

  Returns:
    tokens_BP: int32 [B, max_len], bos + prompt then pad.
    lens_B: int32 [B], real tokens per row (bos included); generation starts at this position.
  """
  _check_max_len(max_len)
  tokens = np.full((len(prompts), max_len), tokenizer.pad_id, np.int32)
  lens = np.zeros((len(prompts),), np.int32)
  for b, prompt in enumerate(prompts):
    ids = prompt_ids(tokenizer, prompt)
    if len(ids) > max_len:
      raise ValueError(f"Prompt {b} ({prompt[:40]!r}) needs {len(ids)} tokens but max_len={max_len}; "
                       "raise max_len (task.max_prompt_len fits every prompt of a task).")
    tokens[b, :len(ids)] = ids
    lens[b] = len(ids)
  return tokens, lens


def encode_sft(tokenizer: Tokenizer, prompts: Sequence[str], targets: Sequence[str],
               max_len: int) -> tuple[np.ndarray, np.ndarray]:
  """Right-padded prompt + target + eos batch with a loss mask on the target tokens and eos.

  Returns:
    tokens_BT: int32 [B, max_len].
    loss_mask_BT: float32 [B, max_len], 1.0 where the token is part of the target or its eos.
  """
  _check_max_len(max_len)
  if len(prompts) != len(targets):
    raise ValueError(f"{len(prompts)} prompts but {len(targets)} targets; pass one target per prompt.")
  tokens = np.full((len(prompts), max_len), tokenizer.pad_id, np.int32)
  mask = np.zeros((len(prompts), max_len), np.float32)
  for b, (prompt, target) in enumerate(zip(prompts, targets)):
    p = prompt_ids(tokenizer, prompt)
    t = tokenizer.encode(target) + [tokenizer.eos_id]
    if len(p) + len(t) > max_len:
      raise ValueError(f"Example {b} needs {len(p) + len(t)} tokens (prompt {len(p)}, target+eos "
                       f"{len(t)}) but max_len={max_len}; raise max_len (task.max_prompt_len + "
                       "task.max_answer_len fits every reference target).")
    tokens[b, :len(p)] = p
    tokens[b, len(p):len(p) + len(t)] = t
    mask[b, len(p):len(p) + len(t)] = 1.0
  return tokens, mask


def decode_batch(tokenizer: Tokenizer, tokens_BT: np.ndarray,
                 start_B: np.ndarray | None = None) -> list[str]:
  """Decodes each row from start_B[b] (e.g. the prompt lengths: completions only) up to its eos."""
  tokens_BT = np.asarray(tokens_BT)
  if tokens_BT.ndim != 2:
    raise ValueError(f"tokens_BT must be 2-D [B, T], got shape {tokens_BT.shape}.")
  if start_B is None:
    start_B = np.zeros((tokens_BT.shape[0],), np.int64)
  start_B = np.asarray(start_B)
  if start_B.shape != (tokens_BT.shape[0],):
    raise ValueError(f"start_B has shape {start_B.shape}; it needs one start per row, "
                     f"shape ({tokens_BT.shape[0]},).")
  return [tokenizer.decode(row[int(s):]) for row, s in zip(tokens_BT, start_B)]
