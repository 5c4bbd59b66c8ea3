"""Procedural verifiable-reward tasks, a JSONL task, tokenizers, batching and pass@k."""
from lowrl.tasks.addition import AdditionTask
from lowrl.tasks.base import Example, ProceduralTask, Task
from lowrl.tasks.batching import decode_batch, encode_prompts, encode_sft, prompt_ids
from lowrl.tasks.countdown import CountdownTask
from lowrl.tasks.eval import pass_at_k, pass_at_k_from_rewards
from lowrl.tasks.jsonl import JsonlTask
from lowrl.tasks.runlength import RunLengthTask
from lowrl.tasks.registry import TASKS, make_task, task_names
from lowrl.tasks.splits import SPLITS, split_of
from lowrl.tasks.strings import ReversalTask, SortingTask, StringTask
from lowrl.tasks.tokenizer import DEFAULT_CHARS, CharTokenizer, Tokenizer
from lowrl.tasks.verifiers import extract_boxed, make_verifier, normalize_answer, register_verifier

__all__ = [
    "AdditionTask", "CharTokenizer", "CountdownTask", "DEFAULT_CHARS", "Example", "JsonlTask",
    "ProceduralTask", "ReversalTask", "RunLengthTask", "SPLITS", "SortingTask", "StringTask",
    "TASKS", "Task",
    "Tokenizer",
    "decode_batch", "encode_prompts", "encode_sft", "extract_boxed", "make_task", "make_verifier",
    "normalize_answer", "pass_at_k", "pass_at_k_from_rewards", "prompt_ids", "register_verifier",
    "split_of", "task_names",
]
