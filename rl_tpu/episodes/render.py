"""The environment's turn as token ids, appended to the ids the engine produced, never re-encoding the model's turn.

Decoding a sampled turn and encoding it again can give other ids (a byte-level BPE merges differently), and the
trainer must score exactly the ids that were sampled. So only the environment's new text is tokenised:

- `chat` (models with a chat template): verl's Continuous Token builder for the model's family renders the tool
  messages as the template would after an assistant turn (a suffix of a synthetic conversation), with the
  family's boundary fix-ups (Qwen's newline after ``<|im_end|>``), and the next generation prompt;
- `plain` (base models without a template, such as the tiny preset): each result in `tool_response_format`.
"""

from __future__ import annotations

import json
from typing import Any, Protocol


class Renderer(Protocol):
    def environment_ids(self, runtime_ids: list[int], calls: list[tuple[str, str]], results: list[str]) -> list[int]:
        """The ids to append after `runtime_ids` (prompt and turns so far) for these calls' (name, JSON arguments)
        results."""


class PlainRenderer:
    def __init__(self, tokenizer: Any, response_format: str):
        self.tokenizer, self.response_format = tokenizer, response_format

    def environment_ids(self, runtime_ids: list[int], calls: list[tuple[str, str]], results: list[str]) -> list[int]:
        text = "".join(self.response_format.format(result=result) for result in results)
        return self.tokenizer.encode(text, add_special_tokens=False)


class ChatRenderer:
    def __init__(self, tokenizer: Any, model_type: str | None, tools: list[dict] | None):
        from verl.utils.tokenizer.continuous_token_wiring import create_continuous_token_builder

        self.builder = create_continuous_token_builder(tokenizer, hf_model_type=model_type)
        self.tools = tools or None

    def environment_ids(self, runtime_ids: list[int], calls: list[tuple[str, str]], results: list[str]) -> list[int]:
        # the assistant message is bookkeeping for the template's tool-response rendering; its ids are the sampled ones
        assistant = {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {"type": "function", "function": {"name": name, "arguments": _arguments(arguments)}}
                for name, arguments in calls
            ],
        }
        tool_messages = [{"role": "tool", "content": result} for result in results]
        merged = self.builder.merge_context_tokens(
            [assistant], [assistant, *tool_messages], runtime_ids, tools=self.tools
        )
        return merged.token_ids[len(runtime_ids) :]


def _arguments(arguments: str) -> dict | str:
    try:
        return json.loads(arguments)
    except json.JSONDecodeError:
        return arguments


def make_renderer(kind: str, tokenizer: Any, response_format: str, model_type: str | None, tools: list[dict] | None):
    """`auto`: `chat` when the tokenizer has a chat template, else `plain`."""
    if kind == "auto":
        kind = "chat" if getattr(tokenizer, "chat_template", None) else "plain"
    if kind == "chat":
        return ChatRenderer(tokenizer, model_type, tools)
    return PlainRenderer(tokenizer, response_format)
