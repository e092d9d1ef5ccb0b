"""The environment's turn as token ids, appended to the ids the engine produced, never re-encoding the model's turn.

Decoding a sampled turn and encoding it again can give other ids (a byte-level BPE merges differently), and the
trainer must score exactly the ids that were sampled. So only the environment's new text is tokenised:

- `chat` (models with a chat template): verl's Continuous Token builder for the model's family (picked by
  `config.json`'s `model_type`) renders the tool messages as the template would after an assistant turn (a suffix
  of a synthetic conversation) and the next generation prompt, with the family's boundary fix-ups: Qwen's newline
  after the ``<|im_end|>`` the engine stopped at, and GLM's stop token that is also the next turn's first token
  (``<|observation|>``, ``<|user|>``). The episode then reads what `apply_chat_template` gives for the whole
  conversation, token for token (tests/unit/test_chat_templates.py: Qwen2.5, Qwen3, Llama 3.1, GLM-4.5);
- `plain` (base models without a template, such as the tiny preset): each result in `tool_response_format`.
"""

from __future__ import annotations

import json
from typing import Any, NamedTuple, Protocol


class EnvironmentIds(NamedTuple):
    """What the environment's turn does to the context: its last `replaced` ids go (a boundary token the template
    renders otherwise), then `ids` are appended."""

    ids: list[int]
    replaced: int = 0


class Renderer(Protocol):
    def environment_ids(
        self, runtime_ids: list[int], calls: list[tuple[str, str]], results: list[str]
    ) -> EnvironmentIds:
        """The environment's turn after `runtime_ids` (prompt and turns so far) for these calls' (name, JSON
        arguments) results."""


class PlainRenderer:
    def __init__(self, tokenizer: Any, response_format: str):
        self.tokenizer, self.response_format = tokenizer, response_format

    def environment_ids(
        self, runtime_ids: list[int], calls: list[tuple[str, str]], results: list[str]
    ) -> EnvironmentIds:
        text = "".join(self.response_format.format(result=result) for result in results)
        return EnvironmentIds(self.tokenizer.encode(text, add_special_tokens=False))


class ChatRenderer:
    def __init__(self, tokenizer: Any, model_type: str | None, tools: list[dict] | None):
        from verl.utils.tokenizer.continuous_token_wiring import create_continuous_token_builder

        self.builder = create_continuous_token_builder(tokenizer, hf_model_type=model_type)
        self.tools = tools or None

    def environment_ids(
        self, runtime_ids: list[int], calls: list[tuple[str, str]], results: list[str]
    ) -> EnvironmentIds:
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
        return kept_model_tokens(runtime_ids, merged.token_ids, merged.removed_prefix_token_count)


def kept_model_tokens(runtime_ids: list[int], merged_ids: list[int], removed: int) -> EnvironmentIds:
    """verl's merge drops the context's last `removed` ids (GLM: the stop token the model ended its turn with) and
    appends the template's tokens. Where those begin with the very ids dropped (the model stopped at
    ``<|observation|>``, which starts the tool turn), the model's ids stay (its stop token is trained, as Qwen's
    ``<|im_end|>`` is); otherwise (it stopped at ``<|user|>`` after a call) they are replaced."""
    kept = len(runtime_ids) - removed
    if merged_ids[:kept] != runtime_ids[:kept]:
        raise RuntimeError("verl's Continuous Token merge changed the episode's ids before its last ones")
    appended = merged_ids[kept:]
    if appended[:removed] == runtime_ids[kept:]:
        return EnvironmentIds(appended[removed:])
    return EnvironmentIds(appended, removed)


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
