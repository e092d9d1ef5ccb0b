"""The chat renderer against the chat templates real models ship (Qwen2.5, Qwen3, Llama 3.1, GLM-4.5:
tests/fixtures/chat_templates/), on a locally built byte-level tokenizer that holds each family's special tokens.

An episode here is built the way the engine builds it: the prompt, then each model turn as the engine returns it
(ending at the family's stop token: Qwen's `<|im_end|>` without the newline the template writes after it), then the
renderer's tool turn; after every tool turn its ids must equal `apply_chat_template` of the conversation so far with
the generation prompt, token for token, and the whole episode must be a prefix of the whole conversation's."""

from __future__ import annotations

import json
from dataclasses import dataclass

import pytest
from chat_model import QWEN_SPECIAL, QWEN_TAGS, byte_tokenizer

from rl_tpu.episodes.loop import Episode
from rl_tpu.episodes.render import ChatRenderer

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "calc",
            "description": "Evaluate an arithmetic expression",
            "parameters": {
                "type": "object",
                "properties": {"expression": {"type": "string"}},
                "required": ["expression"],
            },
        },
    }
]
GLM_SPECIAL = ("[gMASK]", "<sop>", "<|system|>", "<|user|>", "<|assistant|>", "<|observation|>", "<|endoftext|>")
GLM_TAGS = (
    "<think>",
    "</think>",
    "<tool_call>",
    "</tool_call>",
    "<arg_key>",
    "</arg_key>",
    "<arg_value>",
    "</arg_value>",
)


@dataclass(frozen=True)
class Family:
    template: str  # its file in tests/fixtures/chat_templates
    model_type: str  # config.json's: picks verl's builder
    special: tuple[str, ...]
    added: tuple[str, ...]  # tokens of the vocabulary that are not special (tool-call tags)
    stop: str  # where the engine ends a model turn that calls a tool (the id is kept)
    parallel_calls: bool = True
    bos: str | None = None


FAMILIES = {
    "qwen2.5": Family("qwen2_5", "qwen2", QWEN_SPECIAL, QWEN_TAGS, "<|im_end|>"),
    "qwen3": Family("qwen3", "qwen3", QWEN_SPECIAL, (*QWEN_TAGS, "<think>", "</think>"), "<|im_end|>"),
    "llama3.1": Family(
        "llama3_1",
        "llama",
        ("<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>", "<|eom_id|>"),
        ("<|python_tag|>",),
        "<|eot_id|>",
        parallel_calls=False,  # its template raises on more than one call a turn
        bos="<|begin_of_text|>",
    ),
    "glm4.5": Family("glm4moe", "glm4_moe", GLM_SPECIAL, GLM_TAGS, "<|observation|>"),
}


def chat_tokenizer(family: Family):
    return byte_tokenizer(family.template, family.special, family.added, family.special[-1], family.bos)


def render(tokenizer, messages: list[dict], generation_prompt: bool) -> list[int]:
    return list(
        tokenizer.apply_chat_template(
            messages, tools=TOOLS, add_generation_prompt=generation_prompt, tokenize=True, return_dict=False
        )
    )


def call(expression: str) -> dict:
    return {"type": "function", "function": {"name": "calc", "arguments": {"expression": expression}}}


def conversation(family: Family) -> list[list[dict]]:
    """The prompt, then each model turn with its tool results, then the answer: two tool turns (the first with two
    calls where the template allows), with reasoning (Qwen3 and GLM render it)."""
    first = [call("37*48"), call("2+2")] if family.parallel_calls else [call("37*48")]
    results = ["1776", "4"][: len(first)]
    return [
        [{"role": "system", "content": "Use the calculator."}, {"role": "user", "content": "What is 37*48, plus 1?"}],
        [
            {"role": "assistant", "content": "", "reasoning_content": "Multiply first.", "tool_calls": first},
            *({"role": "tool", "content": result} for result in results),
        ],
        [
            {"role": "assistant", "content": "", "reasoning_content": "Then add.", "tool_calls": [call("1776+1")]},
            {"role": "tool", "content": "1777"},
        ],
        [{"role": "assistant", "content": "The answer is 1777.", "reasoning_content": "Done."}],
    ]


def calls_of(assistant: dict) -> list[tuple[str, str]]:
    """The calls as the parser gives them: (name, JSON arguments)."""
    return [(c["function"]["name"], json.dumps(c["function"]["arguments"])) for c in assistant["tool_calls"]]


def model_turn(expected: list[int], start: int, stop_id: int) -> list[int]:
    """The model's turn as the engine returns it: the template's tokens from `start` up to its stop token."""
    return expected[start : expected.index(stop_id, start) + 1]


@pytest.mark.parametrize("name", FAMILIES)
def test_an_episode_is_what_the_template_renders_for_the_whole_conversation(name):
    family = FAMILIES[name]
    tokenizer = chat_tokenizer(family)
    renderer = ChatRenderer(tokenizer, family.model_type, TOOLS)
    stop_id = tokenizer.convert_tokens_to_ids(family.stop)
    prompt, *tool_turns, answer = conversation(family)
    messages, ids = list(prompt), render(tokenizer, prompt, generation_prompt=True)
    for assistant, *results in tool_turns:
        messages += [assistant, *results]
        expected = render(tokenizer, messages, generation_prompt=True)
        assert expected[: len(ids)] == ids  # the template keeps what it rendered before (append only)
        ids += model_turn(expected, len(ids), stop_id)
        turn = renderer.environment_ids(ids, calls_of(assistant), [r["content"] for r in results])
        assert turn.replaced == 0  # the model's ids stay as sampled
        if family.stop == "<|im_end|>":  # Qwen: the newline after <|im_end|> that the engine never returns
            assert tokenizer.decode(turn.ids[:1]) == "\n"
        ids += turn.ids
        assert ids == expected, (tokenizer.decode(ids[-60:]), tokenizer.decode(expected[len(ids) - 60 :]))
    whole = render(tokenizer, messages + answer, generation_prompt=False)
    assert whole[: len(ids)] == ids and tokenizer.decode(whole[len(ids) :]).count("The answer is 1777.") == 1


def test_a_glm_turn_that_stops_at_user_after_a_call_reads_the_observation_the_template_renders():
    """GLM's `<|user|>` and `<|observation|>` both end a model turn and start the next message: a turn that calls a
    tool and stops at `<|user|>` has that id replaced by the tool turn's `<|observation|>` (verl's
    removed_prefix_token_count), and the episode drops it with its logprob and mask."""
    family = FAMILIES["glm4.5"]
    tokenizer = chat_tokenizer(family)
    renderer = ChatRenderer(tokenizer, family.model_type, TOOLS)
    prompt, (assistant, *results), *_ = conversation(family)
    prompt_ids = render(tokenizer, prompt, generation_prompt=True)
    expected = render(tokenizer, [*prompt, assistant, *results], generation_prompt=True)
    sampled = model_turn(expected, len(prompt_ids), tokenizer.convert_tokens_to_ids("<|observation|>"))
    sampled[-1] = tokenizer.convert_tokens_to_ids("<|user|>")
    episode = Episode(prompt_ids, None, 0, 0, {})
    episode.ids, episode.logprobs, episode.mask = list(sampled), [-0.5] * len(sampled), [1] * len(sampled)
    turn = renderer.environment_ids(episode.context(), calls_of(assistant), [r["content"] for r in results])
    assert turn.replaced == 1
    episode.add_environment(turn.ids, turn.replaced)
    assert episode.context() == expected
    model = len(sampled) - 1
    assert episode.mask == [1] * model + [0] * len(turn.ids) and episode.logprobs[model - 1 : model + 1] == [-0.5, 0.0]
