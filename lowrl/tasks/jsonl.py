"""A task read from a JSONL file of {"prompt": ..., "answer": ...} lines, with a pluggable verifier.

Optional per-line "target": the text supervised mid-training trains on (e.g. a worked solution
ending in \\boxed{answer}); without it the target is the answer, wrapped in \\boxed{} for the
"boxed" verifier, and must pass the verifier (checked at load, so a bad reference is found
before training). The split hashes the prompt text, so repeated prompts share a split and the
eval lines never reach training, whatever the file order or seed.

Optional chat template (`chat_template=`): each prompt becomes one user message rendered by the
checkpoint's template (`lowrl.tasks.chat_template`), assistant header included, as
`apply_chat_template(..., add_generation_prompt=True)` writes it. A leading bos_token the
template writes is dropped from the text when the tokenizer has a bos id, since batching
prepends that id itself (one bos, as transformers' tokenized chat has). The split still hashes
the raw prompt, so a template does not move lines between splits.
"""
from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

import numpy as np

from lowrl.tasks import splits, verifiers
from lowrl.tasks.base import Example, Task, check_count, check_rng
from lowrl.tasks.chat_template import ChatTemplate
from lowrl.tasks.tokenizer import CharTokenizer, Tokenizer


def _default_target(verifier_name: str | None, answer: str) -> str:
  return f"\\boxed{{{answer}}}" if verifier_name == "boxed" else answer


class JsonlTask(Task):
  """Prompts and reference answers from a JSONL file."""

  def __init__(self, path: str | os.PathLike, verifier: str | verifiers.Verifier = "exact",
               verifier_kwargs: dict[str, Any] | None = None, eval_fraction: float = 0.1,
               tokenizer: str | os.PathLike | Tokenizer | None = None, max_answer_len: int | None = None,
               name: str = "jsonl", chat_template: str | os.PathLike | ChatTemplate | None = None):
    """Loads and validates the file.

    Args:
      path: the JSONL file; blank lines are skipped.
      verifier: a registered name ("exact", "numeric", "boxed", ...) or a callable
        (completion, answer) -> float.
      verifier_kwargs: options for a named verifier, e.g. {"rtol": 1e-4} for "numeric".
      eval_fraction: share of distinct prompts held out for evaluation.
      tokenizer: None = a CharTokenizer over the file's characters; a path = a tokenizer.json
        or its checkpoint directory (`lowrl.checkpoints.load_tokenizer`); or any `Tokenizer`.
      max_answer_len: generation budget in tokens incl. eos, at least the longest target + eos
        (the default).
      name: task name (also salts the split keys).
      chat_template: None = prompts as written (the default); a checkpoint directory = its chat
        template (chat_template.jinja or tokenizer_config.json) and special tokens; or a
        `ChatTemplate`. Each prompt is rendered as a single user message plus the assistant
        header; Example.metadata["raw_prompt"] keeps the line's text.
    """
    splits.check_eval_fraction(eval_fraction)
    self.name = name
    self.path = os.fspath(path)
    self.eval_fraction = float(eval_fraction)
    if callable(verifier):
      if verifier_kwargs:
        raise ValueError("verifier_kwargs only applies to a named verifier; "
                         "configure the callable yourself.")
      self._verifier_name, self.verifier = None, verifier
    else:
      self._verifier_name = verifier
      self.verifier = verifiers.make_verifier(verifier, **(verifier_kwargs or {}))

    if isinstance(chat_template, (str, os.PathLike)):
      chat_template = ChatTemplate.from_checkpoint(chat_template)
    elif chat_template is not None and not isinstance(chat_template, ChatTemplate):
      raise ValueError("chat_template must be None, a checkpoint directory or a ChatTemplate, "
                       f"got {type(chat_template).__name__}.")
    self.chat_template = chat_template
    rows = self._load()
    self._by_split: dict[str, list[Example]] = {s: [] for s in splits.SPLITS}
    for lineno, prompt, answer, target in rows:
      key = f"{self.name}|{prompt}"
      split = splits.split_of(key, self.eval_fraction)
      meta = {"line": lineno, "key": key, "split": split, "target": target}
      shown = prompt
      if chat_template is not None:
        shown, meta["raw_prompt"] = chat_template.render_prompt(prompt), prompt
      ex = Example(shown, answer, meta)
      if target is None:
        try:
          ok = self.verifier(self.target_text(ex), answer) == 1.0
        except ValueError as e:
          raise ValueError(f"{self.path}:{lineno}: {e}") from e
        if not ok:
          raise ValueError(f"{self.path}:{lineno}: the answer {answer!r} does not pass its own verifier "
                           f"({verifier!r}); fix the answer or give a \"target\" the verifier accepts.")
      self._by_split[split].append(ex)

    all_examples = self._by_split["train"] + self._by_split["eval"]
    if tokenizer is None:
      tokenizer = CharTokenizer.from_texts([e.prompt for e in all_examples] +
                                           [self.target_text(e) for e in all_examples])
    elif isinstance(tokenizer, (str, os.PathLike)):
      # Imported here: lowrl.checkpoints pulls in the models (jax) and `tokenizers`.
      from lowrl.checkpoints.tokenizer import load_tokenizer
      tokenizer = load_tokenizer(tokenizer)
    elif not isinstance(tokenizer, Tokenizer):
      raise ValueError("tokenizer must be None, a tokenizer.json path or a Tokenizer, "
                       f"got {type(tokenizer).__name__}.")
    self.tokenizer = tokenizer
    bos_text = None if chat_template is None else chat_template.special_token("bos_token")
    if tokenizer.bos_id is not None and isinstance(bos_text, str) and bos_text:
      # Batching prepends the bos id itself: a bos the template writes would make two.
      for examples in self._by_split.values():
        examples[:] = [dataclasses.replace(e, prompt=e.prompt.removeprefix(bos_text))
                       for e in examples]
      all_examples = self._by_split["train"] + self._by_split["eval"]
    bos = 0 if tokenizer.bos_id is None else 1
    self.max_prompt_len = bos + max(len(tokenizer.encode(e.prompt)) for e in all_examples)
    longest_target = 1 + max(len(tokenizer.encode(self.target_text(e))) for e in all_examples)
    if max_answer_len is None:
      max_answer_len = longest_target
    elif max_answer_len < longest_target:
      # Keeps the Task promise that max_prompt_len + max_answer_len fits every SFT target.
      raise ValueError(f"max_answer_len={max_answer_len} but the longest target needs "
                       f"{longest_target} tokens (eos included); raise it or leave it None.")
    self.max_answer_len = int(max_answer_len)

  def _load(self) -> list[tuple[int, str, str, str | None]]:
    rows = []
    try:
      f = open(self.path, "rb")  # bytes: a decoding error is reported with its line
    except OSError as e:
      where = ("" if os.path.isabs(self.path)
               else f" (a relative path is read from the current directory {os.getcwd()})")
      raise ValueError(f"Cannot read JSONL file {self.path!r}: {e.strerror or e}; pass the path of "
                       f"an existing file{where} with one {{\"prompt\": ..., \"answer\": ...}} "
                       "object per line.") from e
    with f:
      for lineno, raw in enumerate(f, start=1):
        where = f"{self.path}:{lineno}"
        try:
          line = raw.decode("utf-8")
        except UnicodeDecodeError as e:
          raise ValueError(f"{where}: not valid UTF-8 (byte 0x{raw[e.start]:02x} at column "
                           f"{e.start + 1}); save the file as UTF-8.") from None
        if not line.strip():
          continue
        try:
          obj = json.loads(line)
        except json.JSONDecodeError as e:
          raise ValueError(f"{where}: not valid JSON ({e.msg}); "
                           "write one JSON object per line.") from None
        if not isinstance(obj, dict):
          raise ValueError(f"{where}: expected a JSON object with \"prompt\" and \"answer\", "
                           f"got {type(obj).__name__}.")
        prompt, answer, target = obj.get("prompt"), obj.get("answer"), obj.get("target")
        if not isinstance(prompt, str):
          raise ValueError(f"{where}: \"prompt\" must be a string, got {prompt!r}.")
        if isinstance(answer, (int, float)) and not isinstance(answer, bool):
          answer = json.dumps(answer)  # 42 -> "42", 0.5 -> "0.5"
        if not isinstance(answer, str):
          raise ValueError(f"{where}: \"answer\" must be a string or a number, got {answer!r}.")
        if target is not None and not isinstance(target, str):
          raise ValueError(f"{where}: \"target\" must be a string when given, got {target!r}.")
        rows.append((lineno, prompt, answer, target))
    if not rows:
      raise ValueError(f"{self.path!r} has no examples; "
                       'add lines like {"prompt": "1+1=", "answer": "2"}.')
    return rows

  def examples(self, split: str) -> list[Example]:
    """Every example of `split`, in file order (for full evaluation passes)."""
    splits.check_split(split)
    return list(self._by_split[split])

  def sample(self, rng: np.random.Generator, n: int, split: str = "train") -> list[Example]:
    """`n` examples of `split` drawn uniformly with replacement using `rng`."""
    splits.check_split(split)
    check_count(n)
    check_rng(rng)
    pool = self._by_split[split]
    if not pool:
      counts = {s: len(v) for s, v in self._by_split.items()}
      raise ValueError(f"The {split!r} split of {self.path!r} is empty ({counts['train']} train, "
                       f"{counts['eval']} eval examples); add lines or change eval_fraction.")
    return [pool[int(i)] for i in rng.integers(0, len(pool), size=n)]

  def reward(self, completion: str, example: Example) -> float:
    return float(self.verifier(completion, example.answer))

  def target_text(self, example: Example) -> str:
    """The line's "target" if it has one, else the answer (\\boxed{answer} for the boxed verifier)."""
    target = example.metadata.get("target")
    return target if target is not None else _default_target(self._verifier_name, example.answer)

