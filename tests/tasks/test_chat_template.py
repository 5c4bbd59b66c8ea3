"""Chat templates render as transformers' apply_chat_template does (expected strings written by
hand from the template semantics), and the JSONL task's chat_template option."""
import json
from datetime import datetime

import pytest

from lowrl.tasks import chat_template as ct
from lowrl.tasks.batching import prompt_ids
from lowrl.tasks.chat_template import ChatTemplate, render_prompt
from lowrl.tasks.jsonl import JsonlTask

# Qwen2.5-Instruct's tokenizer_config.json chat_template (the JSON string with its \n expanded).
QWEN25_TEMPLATE = """{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0]['role'] == 'system' %}
        {{- messages[0]['content'] }}
    {%- else %}
        {{- 'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.' }}
    {%- endif %}
    {{- "\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\nYou are provided with function signatures within <tools></tools> XML tags:\\n<tools>" }}
    {%- for tool in tools %}
        {{- "\\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\"name\\": <function-name>, \\"arguments\\": <args-json-object>}\\n</tool_call><|im_end|>\\n" }}
{%- else %}
    {%- if messages[0]['role'] == 'system' %}
        {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}
    {%- else %}
        {{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\\n' }}
    {%- endif %}
{%- endif %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) or (message.role == "assistant" and not message.tool_calls) %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>' + message.role }}
        {%- if message.content %}
            {{- '\\n' + message.content }}
        {%- endif %}
        {%- for tool_call in message.tool_calls %}
            {%- if tool_call.function is defined %}
                {%- set tool_call = tool_call.function %}
            {%- endif %}
            {{- '\\n<tool_call>\\n{"name": "' }}
            {{- tool_call.name }}
            {{- '", "arguments": ' }}
            {{- tool_call.arguments | tojson }}
            {{- '}\\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == "tool" %}
        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\\n<tool_response>\\n' }}
        {{- message.content }}
        {{- '\\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""
QWEN25_CONFIG = {"bos_token": None, "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>",
                 "chat_template": QWEN25_TEMPLATE}
QWEN_SYSTEM = "<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\n"

# Meta-Llama-3-8B-Instruct's chat_template: bos_token, header ids, content | trim.
LLAMA3_TEMPLATE = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}{% set content = "
    "'<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'+ message['content'] | trim"
    " + '<|eot_id|>' %}{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}"
    "{{ content }}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}")
# AddedToken dicts, as older tokenizer_config.json files store special tokens.
LLAMA3_CONFIG = {"bos_token": {"__type": "AddedToken", "content": "<|begin_of_text|>",
                               "lstrip": False, "normalized": False, "rstrip": False,
                               "single_word": False},
                 "eos_token": "<|eot_id|>", "chat_template": LLAMA3_TEMPLATE}


def test_qwen25_single_user_message():
  got = render_prompt(QWEN25_TEMPLATE, QWEN25_CONFIG, "What is 2+2?")
  assert got == QWEN_SYSTEM + "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n"
  no_header = render_prompt(QWEN25_TEMPLATE, QWEN25_CONFIG, "hi", add_generation_prompt=False)
  assert no_header == QWEN_SYSTEM + "<|im_start|>user\nhi<|im_end|>\n"


def test_qwen25_conversation_with_tools_and_tojson():
  # tojson keeps non-ASCII and <, >, & as they are (transformers' filter, not jinja's HTML-safe
  # one, which would write \u003c and \u00e9).
  tool = {"type": "function", "function": {"name": "add", "description": "a<b & café"}}
  messages = [{"role": "system", "content": "Be brief."},
              {"role": "user", "content": "1+2?"},
              {"role": "assistant", "content": "",
               "tool_calls": [{"function": {"name": "add", "arguments": {"a": 1, "b": 2}}}]},
              {"role": "tool", "content": "3"}, {"role": "tool", "content": "ok"}]
  got = ChatTemplate.from_tokenizer_config(QWEN25_CONFIG).render(messages, tools=[tool])
  want = ("<|im_start|>system\nBe brief.\n\n# Tools\n\nYou may call one or more functions to "
          "assist with the user query.\n\nYou are provided with function signatures within "
          "<tools></tools> XML tags:\n<tools>\n"
          '{"type": "function", "function": {"name": "add", "description": "a<b & café"}}'
          "\n</tools>\n\nFor each function call, return a json object with function name and "
          "arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n"
          '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call><|im_end|>\n'
          "<|im_start|>user\n1+2?<|im_end|>\n"
          '<|im_start|>assistant\n<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n'
          "</tool_call><|im_end|>\n"
          "<|im_start|>user\n<tool_response>\n3\n</tool_response>\n<tool_response>\nok\n"
          "</tool_response><|im_end|>\n<|im_start|>assistant\n")
  assert got == want


def test_llama3_bos_headers_and_trim():
  got = render_prompt(LLAMA3_TEMPLATE, LLAMA3_CONFIG, "  What is 2+2?\n")
  assert got == ("<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nWhat is 2+2?"
                 "<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n")


def test_special_tokens_map_and_variables():
  tc = dict(LLAMA3_CONFIG, pad_token=None, additional_special_tokens=["<a>", {"content": "<b>"}])
  t = ChatTemplate.from_tokenizer_config(tc, "{{ bos_token }}|{{ eos_token }}|"
                                         "{{ pad_token is defined }}|{{ additional_special_tokens | join(',') }}"
                                         "|{{ date_string }}", date_string="26 Jul 2024")
  assert t.special_tokens == (("bos_token", "<|begin_of_text|>"), ("eos_token", "<|eot_id|>"),
                              ("additional_special_tokens", ("<a>", "<b>")))
  assert t.render([]) == "<|begin_of_text|>|<|eot_id|>|False|<a>,<b>|26 Jul 2024"
  # A caller's variable overrides a special token, as in transformers' {**special, **kwargs}.
  assert t.render([], bos_token="<s>", date_string="x").startswith("<s>|<|eot_id|>|False|<a>,<b>|x")
  hash(t)  # frozen and hashable


def test_raise_exception_is_a_clear_error():
  template = ("{% for m in messages %}{% if m['role'] not in ['user', 'assistant'] %}"
              "{{ raise_exception('Only user and assistant roles are supported!') }}{% endif %}"
              "{{ m['content'] }}{% endfor %}")
  t = ChatTemplate(template)
  assert t.render([{"role": "user", "content": "a"}]) == "a"
  with pytest.raises(ValueError, match="refused the conversation: Only user and assistant roles"):
    t.render([{"role": "system", "content": "s"}])


def test_sandbox_and_syntax_errors():
  with pytest.raises(ValueError, match="sandbox"):
    ChatTemplate("{{ messages.append(1) }}").render([])
  with pytest.raises(ValueError, match="not valid Jinja .*line 2"):
    ChatTemplate("ok\n{% if %}")
  with pytest.raises(ValueError, match="no chat_template"):
    ChatTemplate.from_tokenizer_config({"eos_token": "</s>"})


def test_loop_controls_trim_and_lstrip_blocks():
  # trim_blocks drops the newline after a block tag, lstrip_blocks the indentation before it;
  # the newline after a {{ }} expression stays. continue skips the system message, break stops
  # after the third message.
  template = ("{% for m in messages %}\n"
              "    {% if m['role'] == 'system' %}\n"
              "        {% continue %}\n"
              "    {% endif %}\n"
              "[{{ m['role'] }}] {{ m['content'] }}\n"
              "    {% if loop.index >= 3 %}\n"
              "        {% break %}\n"
              "    {% endif %}\n"
              "{% endfor %}\n"
              "{% if add_generation_prompt %}\n"
              "  > \n"
              "{% endif %}")
  messages = [{"role": "system", "content": "s"}, {"role": "user", "content": "a"},
              {"role": "assistant", "content": "b"}, {"role": "user", "content": "c"}]
  t = ChatTemplate(template)
  assert t.render(messages) == "[user] a\n[assistant] b\n  > \n"
  assert t.render(messages, add_generation_prompt=False) == "[user] a\n[assistant] b\n"


def test_generation_tag_and_strftime_now(monkeypatch):
  monkeypatch.setattr(ct, "_now", lambda: datetime(2024, 7, 26, 10, 0))
  t = ChatTemplate("{% generation %}{{ messages[0]['content'] }}{% endgeneration %} "
                   "{{ strftime_now('%d %b %Y') }}")
  assert t.render([{"role": "user", "content": "x"}]) == "x 26 Jul 2024"


def test_from_checkpoint_prefers_chat_template_jinja(tmp_path):
  (tmp_path / "tokenizer_config.json").write_text(json.dumps(QWEN25_CONFIG))
  t = ChatTemplate.from_checkpoint(tmp_path)
  assert t.template == QWEN25_TEMPLATE and t.special_token("eos_token") == "<|im_end|>"
  assert t.special_token("bos_token") is None
  (tmp_path / "chat_template.jinja").write_text("<{{ messages[0]['content'] }}>")
  assert ChatTemplate.from_checkpoint(tmp_path).render_prompt("q") == "<q>"
  named = dict(QWEN25_CONFIG, chat_template=[{"name": "tool_use", "template": "T"},
                                              {"name": "default", "template": "D"}])
  assert ChatTemplate.from_tokenizer_config(named).template == "D"


def _jsonl(path, rows):
  path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
  return path


def test_jsonl_task_chat_template(tmp_path):
  rows = [{"prompt": f"{a}+{b}=", "answer": str(a + b)} for a in range(6) for b in range(6)]
  path = _jsonl(tmp_path / "add.jsonl", rows)
  plain = JsonlTask(path)
  llama = ChatTemplate.from_tokenizer_config(LLAMA3_CONFIG)
  task = JsonlTask(path, chat_template=llama)
  for split in ("train", "eval"):
    a, b = plain.examples(split), task.examples(split)
    assert [e.prompt for e in a] == [e.metadata["raw_prompt"] for e in b]  # same split
    # The char tokenizer has a bos id, so the template's leading bos text is dropped.
    assert [e.prompt for e in b] == [
        "<|start_header_id|>user<|end_header_id|>\n\n" + e.prompt +
        "<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n" for e in a]
  e = task.examples("train")[0]
  ids = prompt_ids(task.tokenizer, e.prompt)
  assert ids[0] == task.tokenizer.bos_id and task.tokenizer.bos_id not in ids[1:]
  assert "raw_prompt" not in plain.examples("train")[0].metadata  # default unchanged
  # A checkpoint directory works too (Qwen: no bos, nothing dropped).
  (tmp_path / "tokenizer_config.json").write_text(json.dumps(QWEN25_CONFIG))
  qwen = JsonlTask(path, chat_template=str(tmp_path))
  assert qwen.examples("eval")[0].prompt == (
      QWEN_SYSTEM + f"<|im_start|>user\n{plain.examples('eval')[0].prompt}<|im_end|>\n"
      "<|im_start|>assistant\n")
  with pytest.raises(ValueError, match="chat_template must be"):
    JsonlTask(path, chat_template=3)
