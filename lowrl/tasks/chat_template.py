"""A checkpoint's Jinja chat template, rendered the way transformers' `apply_chat_template` does.

The environment follows transformers (`utils/chat_template_utils.py`, `_compile_jinja_template`
and `render_jinja_template`): jinja2's `ImmutableSandboxedEnvironment` with `trim_blocks` and
`lstrip_blocks` on (without them a template's own indentation and line breaks land in the
prompt), the `loopcontrols` extension (`{% break %}`, `{% continue %}`), a `{% generation %}`
tag that renders its body (transformers uses it to track assistant spans; we only render), the
globals `raise_exception(message)` and `strftime_now(format)`, and a `tojson` filter that is
`json.dumps(x, ensure_ascii=False, indent=..., separators=..., sort_keys=...)` (jinja's own
escapes `<`, `>`, `&` and `'` for HTML). The variables are `messages`, `tools` (None),
`documents` (None), `add_generation_prompt`, and the tokenizer's special tokens by name
(`bos_token`, `eos_token`, `unk_token`, `sep_token`, `pad_token`, `cls_token`, `mask_token`,
`additional_special_tokens`: transformers' `special_tokens_map`), with caller variables
overriding them (`{**special_tokens_map, **kwargs}`).

Templates that call `strftime_now` (Llama 3.1+ writes today's date into the system header unless
`date_string` is given) render differently on different days; pass the variable to pin it.
"""
from __future__ import annotations

import dataclasses
import functools
import json
import os
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.sandbox

TOKENIZER_CONFIG = "tokenizer_config.json"
TEMPLATE_FILE = "chat_template.jinja"  # transformers >= 4.50 saves the template here
# transformers' SPECIAL_TOKENS_ATTRIBUTES: the names a template sees the special tokens under.
SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token",
                       "cls_token", "mask_token", "additional_special_tokens")


class _Generation(jinja2.ext.Extension):
  """`{% generation %}...{% endgeneration %}`: renders the body (spans are not tracked)."""

  tags = {"generation"}

  def parse(self, parser):
    lineno = next(parser.stream).lineno
    body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
    return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

  def _body(self, caller):
    return caller()


def _raise_exception(message: str):
  raise jinja2.exceptions.TemplateError(message)


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | str | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
  return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                    sort_keys=sort_keys)


def _now() -> datetime:
  """The clock strftime_now reads (a function so tests can pin it)."""
  return datetime.now()


def _strftime_now(fmt: str) -> str:
  return _now().strftime(fmt)


@functools.lru_cache(maxsize=16)
def _compile(template: str) -> jinja2.Template:
  env = jinja2.sandbox.ImmutableSandboxedEnvironment(
      trim_blocks=True, lstrip_blocks=True, extensions=[_Generation, jinja2.ext.loopcontrols])
  env.filters["tojson"] = _tojson
  env.globals["raise_exception"] = _raise_exception
  env.globals["strftime_now"] = _strftime_now
  try:
    return env.from_string(template)
  except jinja2.exceptions.TemplateSyntaxError as e:
    raise ValueError(f"The chat template is not valid Jinja (template line {e.lineno}: "
                     f"{e.message}); fix chat_template in {TOKENIZER_CONFIG}.") from None


def _token_text(token: Any) -> Any:
  """A special token as a template sees it: the string (an AddedToken dict's `content`)."""
  if isinstance(token, Mapping):
    return token.get("content")
  if isinstance(token, (list, tuple)):
    return tuple(_token_text(t) for t in token)
  return token


def special_tokens(tokenizer_config: Mapping[str, Any]) -> tuple[tuple[str, Any], ...]:
  """transformers' `special_tokens_map` of a tokenizer_config.json dict: (name, text) pairs of
  the tokens it sets (None and absent ones left out, as transformers does)."""
  out = []
  for name in SPECIAL_TOKEN_NAMES:
    value = _token_text(tokenizer_config.get(name))
    if value is not None and value != ():
      out.append((name, value))
  return tuple(out)


def _select_template(value: Any, where: str) -> str:
  """The template text of a `chat_template` entry: a string, or transformers' list of named
  templates ({"name", "template"}), of which "default" is the one apply_chat_template uses."""
  if isinstance(value, str):
    return value
  if isinstance(value, list):
    named = {t.get("name"): t.get("template") for t in value if isinstance(t, Mapping)}
    if isinstance(named.get("default"), str):
      return named["default"]
    raise ValueError(f"{where}: chat_template lists named templates {sorted(map(str, named))} "
                     "but none is called 'default'; pass the one to use as the template text.")
  raise ValueError(f"{where} has no chat_template (a base model?); use a chat checkpoint or "
                   "give the template text.")


def _plain(value: Any) -> Any:
  """Tuples (kept hashable in the dataclass) back to lists, as the template's data expects."""
  if isinstance(value, tuple):
    return [_plain(v) for v in value]
  return value


@dataclasses.dataclass(frozen=True)
class ChatTemplate:
  """A chat template with the special tokens (and extra variables) it is rendered with.

  Attributes:
    template: the Jinja source.
    special_tokens: (name, text) pairs, e.g. (("bos_token", "<s>"), ("eos_token", "</s>")).
    variables: (name, value) pairs of extra template variables, e.g. (("date_string",
      "26 Jul 2024"),); they override special tokens of the same name.
  """

  template: str
  special_tokens: tuple[tuple[str, Any], ...] = ()
  variables: tuple[tuple[str, Any], ...] = ()

  def __post_init__(self):
    if not isinstance(self.template, str) or not self.template:
      raise ValueError("ChatTemplate needs the template text (a non-empty string).")
    _compile(self.template)  # a syntax error surfaces here, before any use

  @classmethod
  def from_tokenizer_config(cls, tokenizer_config: Mapping[str, Any],
                            template: str | None = None,
                            **variables: Any) -> ChatTemplate:
    """The template of a tokenizer_config.json dict (or `template`) with its special tokens."""
    if template is None:
      template = _select_template(tokenizer_config.get("chat_template"), TOKENIZER_CONFIG)
    return cls(template, special_tokens(tokenizer_config), tuple(sorted(variables.items())))

  @classmethod
  def from_checkpoint(cls, path: str | os.PathLike, **variables: Any) -> ChatTemplate:
    """The chat template of a checkpoint directory: chat_template.jinja if present (transformers
    prefers it), else tokenizer_config.json's chat_template; special tokens from the latter. A
    `.gguf` file: its tokenizer.chat_template and special tokens."""
    path = os.fspath(path)
    if path.lower().endswith(".gguf"):
      # Imported here: lowrl.checkpoints pulls in the models (jax) and `tokenizers`.
      from lowrl.checkpoints.gguf_tokenizer import read_tokenizer_config
      config = read_tokenizer_config(path)
      return cls.from_tokenizer_config(
          config, _select_template(config.get("chat_template"), path), **variables)
    config_file = os.path.join(path, TOKENIZER_CONFIG)
    if not os.path.isdir(path):
      raise FileNotFoundError(f"Checkpoint directory {path!r} does not exist (needed for its "
                              "chat template).")
    config: dict[str, Any] = {}
    if os.path.isfile(config_file):
      try:
        with open(config_file, encoding="utf-8") as fh:
          config = json.load(fh)
      except json.JSONDecodeError as e:
        raise ValueError(f"{config_file} is not valid JSON ({e}); re-download or fix it.") from e
    template_file = os.path.join(path, TEMPLATE_FILE)
    if os.path.isfile(template_file):
      with open(template_file, encoding="utf-8") as fh:
        template = fh.read()
    elif config:
      template = _select_template(config.get("chat_template"), config_file)
    else:
      raise FileNotFoundError(f"{path!r} has neither {TEMPLATE_FILE} nor {TOKENIZER_CONFIG}; "
                              "a chat template comes from one of them.")
    return cls.from_tokenizer_config(config, template, **variables)

  def special_token(self, name: str) -> Any:
    """The text of special token `name` ("bos_token", ...), None if the tokenizer has none."""
    return dict(self.special_tokens).get(name)

  def render(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True,
             **variables: Any) -> str:
    """The conversation `messages` ({"role", "content"} dicts) as the template writes it.

    Raises ValueError when the template calls raise_exception (its message is kept), breaks the
    sandbox rules (e.g. mutates its input) or fails otherwise.
    """
    context = {name: _plain(value) for name, value in self.special_tokens}
    context.update((name, _plain(value)) for name, value in self.variables)
    context.update(variables)
    try:
      return _compile(self.template).render(
          messages=[dict(m) for m in messages], tools=context.pop("tools", None),
          documents=context.pop("documents", None), add_generation_prompt=add_generation_prompt,
          **context)
    except jinja2.exceptions.SecurityError as e:
      raise ValueError(f"The chat template broke the sandbox rules ({e}); it must not modify "
                       "its inputs or reach Python internals.") from None
    except jinja2.exceptions.TemplateError as e:
      raise ValueError(f"The chat template refused the conversation: {e}") from None
    except (TypeError, KeyError, IndexError, AttributeError) as e:
      raise ValueError(f"The chat template failed on this conversation ({type(e).__name__}: "
                       f"{e}).") from None

  def render_prompt(self, user_text: str, add_generation_prompt: bool = True) -> str:
    """One user message, followed by the assistant header when add_generation_prompt."""
    return self.render([{"role": "user", "content": user_text}], add_generation_prompt)


def render_prompt(template: str, tokenizer_config: Mapping[str, Any], user_text: str,
                  add_generation_prompt: bool = True) -> str:
  """`user_text` as a single user message rendered by `template` with the special tokens of
  `tokenizer_config` (a tokenizer_config.json dict): what
  `tokenizer.apply_chat_template([{"role": "user", "content": user_text}], tokenize=False,
  add_generation_prompt=add_generation_prompt)` returns."""
  return ChatTemplate.from_tokenizer_config(tokenizer_config, template).render_prompt(
      user_text, add_generation_prompt)
