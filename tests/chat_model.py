"""A tiny chat model built locally (no downloads) for the end-to-end tests of the chat renderer: a Qwen2 decoder
(`model_type` qwen2, so verl's Continuous Token builder takes its Qwen path) with a byte-level tokenizer holding
Qwen2.5's special tokens and tool-call tags and Qwen2.5's chat template (tests/fixtures/chat_templates/).

Random weights call no tool, so a short supervised warm start overfits two conversations per training prompt of
the tests' runs, rendered by the template: the question, a `calculator` call with the problem's expression, its
result, then the final answer (`#### N` for GSM8K, `<answer>N</answer>` for reasoning-gym) or a final turn with no
number at all (so a run holds episodes whose only number is in a tool result). The template's system text (its
tool block) and GSM8K's instruction are single tokens of the vocabulary, so a conversation is about 270 tokens:
250 full-batch steps on 8 of them, 29 s with one thread on a 2-core host at a load average of 8 (2026-12-07; with
two threads beside other work, 9 to 17 minutes: see conftest's OMP_NUM_THREADS). conftest's `chat_model_dir` builds
it once per session.
"""

from __future__ import annotations

import json
import logging
import math
import re
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TEMPLATES = REPO / "tests" / "fixtures" / "chat_templates"
QWEN_SPECIAL = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
QWEN_TAGS = ("<tool_call>", "</tool_call>")
CALCULATOR_YAML = REPO / "examples" / "tools" / "calculator.yaml"
GSM8K_ROWS = (14, 4)  # short questions of tests/fixtures/gsm8k/train.jsonl whose last step is an integer expression
# the reasoning-gym task of the test's run (data.reasoning_gym.*): short questions, a valid calculator expression
REASONING_GYM = {"task": "basic_arithmetic", "config": {"max_terms": 2, "max_digits": 2}, "size": 2, "num_eval": 1}
NO_NUMBER = "The calculator has it."  # a final turn that answers nothing
WARM_START_STEPS, WARM_START_LR = 250, 1e-2
MAX_WARM_START_LOSS = 0.03  # per token; the taught turns are sampled reliably below it
log = logging.getLogger(__name__)


def byte_tokenizer(template: str, special: tuple[str, ...], added: tuple[str, ...], eos: str, bos: str | None = None):
    """A byte-level BPE without merges (every byte one token) plus the family's special tokens, the `added`
    (not special) tokens, and the chat template of tests/fixtures/chat_templates/`template`.jinja."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    core = Tokenizer(models.BPE(vocab={byte: i for i, byte in enumerate(alphabet)}, merges=[]))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, bos_token=bos, eos_token=eos)
    tokenizer.add_special_tokens({"additional_special_tokens": list(special)})
    tokenizer.add_tokens(list(added))
    tokenizer.chat_template = (TEMPLATES / f"{template}.jinja").read_text()
    return tokenizer


def calculator_schemas() -> list[dict]:
    """The calculator's schema as the tool workers give it to the chat template (rl_tpu/episodes/tool_worker.py)."""
    import yaml
    from verl.tools.schemas import OpenAIFunctionToolSchema

    (entry,) = yaml.safe_load(CALCULATOR_YAML.read_text())["tools"]
    return [
        OpenAIFunctionToolSchema.model_validate(entry["tool_schema"]).model_dump(exclude_unset=True, exclude_none=True)
    ]


def gsm8k_rows() -> list[dict]:
    """The GSM8K fixture rows of the tests' runs, in verl's schema (recipes/grpo_gsm8k/prepare.py)."""
    from recipes.grpo_gsm8k.prepare import verl_row

    path = REPO / "tests" / "fixtures" / "gsm8k" / "train.jsonl"
    lines = path.read_text().splitlines()
    return [verl_row(json.loads(lines[i]), "train", i, path) for i in GSM8K_ROWS]


def reasoning_gym_rows() -> list[dict]:
    """The reasoning-gym rows a run with `REASONING_GYM`'s settings (and data.seed=0) trains on."""
    from rl_tpu.config.reasoning_gym import ReasoningGymConfig
    from rl_tpu.data.reasoning_gym import entry_rows

    rg = REASONING_GYM
    cfg = ReasoningGymConfig(task=rg["task"], config=rg["config"], size=rg["size"], system_prompt=None)
    return entry_rows(cfg, 0, rg["size"], "train", skip=set())


def expression_of(row: dict) -> str:
    """The calculator expression that answers a row: GSM8K's last annotated step, reasoning-gym's question."""
    if row["data_source"].startswith("reasoning_gym/"):
        return re.fullmatch(r"Calculate (.*)\.", row["prompt"][-1]["content"]).group(1)
    return re.findall(r"<<([^=]+)=", row["extra_info"]["answer"])[-1]


def final_answer(row: dict) -> str:
    truth = row["reward_model"]["ground_truth"]
    return f"<answer>{truth}</answer>" if row["data_source"].startswith("reasoning_gym/") else f"#### {truth}"


def tool_result(expression: str) -> str:
    sys.path.insert(0, str(CALCULATOR_YAML.parent))  # the tool's module, as the tool workers import it
    try:
        from calculator import evaluate
    finally:
        sys.path.remove(str(CALCULATOR_YAML.parent))
    return evaluate(expression)


def conversations(rows: list[dict]) -> list[list[dict]]:
    """Per row, two conversations: a call, its result, then the right answer or `NO_NUMBER`."""
    out = []
    for row in rows:
        expression = expression_of(row)
        call = {"type": "function", "function": {"name": "calculator", "arguments": {"expression": expression}}}
        turn = [
            {"role": "assistant", "content": "", "tool_calls": [call]},
            {"role": "tool", "content": tool_result(expression)},
        ]
        for final in (final_answer(row), NO_NUMBER):
            out.append([*row["prompt"], *turn, {"role": "assistant", "content": final}])
    return out


def chat_tokenizer():
    """Qwen2.5's tokens and template, and as single tokens the system text it writes for the calculator and GSM8K's
    instruction."""
    from recipes.grpo_gsm8k.prepare import INSTRUCTION

    tokenizer = byte_tokenizer("qwen2_5", QWEN_SPECIAL, QWEN_TAGS, eos="<|im_end|>")
    text = tokenizer.apply_chat_template([{"role": "user", "content": "?"}], tools=calculator_schemas(), tokenize=False)
    system = text[len("<|im_start|>system\n") : text.index("<|im_end|>")]
    tokenizer.add_tokens([system, " " + INSTRUCTION])
    tokenizer.pad_token = "<|endoftext|>"
    return tokenizer


def example(tokenizer, messages: list[dict]) -> tuple[list[int], list[int], list[int]]:
    """A conversation as the engine and the renderer make its ids: the prompt, then the completion and its mask (1
    on the model's turns, each up to its `<|im_end|>`, 0 on the template's tool turn)."""
    tools, end = calculator_schemas(), tokenizer.convert_tokens_to_ids("<|im_end|>")

    def render(upto: int, generation: bool) -> list[int]:
        kwargs = {"tools": tools, "add_generation_prompt": generation, "tokenize": True, "return_dict": False}
        return list(tokenizer.apply_chat_template(messages[:upto], **kwargs))

    prompt = render(len(messages) - 3, True)
    after_tool, whole = render(len(messages) - 1, True), render(len(messages), False)
    call_end = after_tool.index(end, len(prompt)) + 1
    answer_end = whole.index(end, len(after_tool)) + 1
    completion = whole[len(prompt) : answer_end]
    mask = [1] * (call_end - len(prompt)) + [0] * (len(after_tool) - call_end) + [1] * (answer_end - len(after_tool))
    return prompt, completion, mask


def warm_start(model, tokenizer, examples: list[tuple[list[int], list[int], list[int]]], steps: int) -> float:
    """Full-batch supervised steps on the model's turns; returns the last loss (per token)."""
    import torch

    from rl_tpu.models.logprobs import pad_batch, token_logprobs
    from rl_tpu.records import TrainBatch

    prompts, completions, masks = (list(part) for part in zip(*examples))
    zeros = [[0.0] * len(c) for c in completions]
    t = pad_batch(
        TrainBatch(prompts, completions, zeros, zeros, 1.0, model_masks=masks),
        tokenizer.pad_token_id,
        torch.device("cpu"),
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=WARM_START_LR, weight_decay=0.0)
    # warm-up, then a cosine decay to 0, and clipped gradients: at a constant rate, unclipped, the loss jumped about
    # (1.9 at step 150 of 200) and where it ended hung on the host's kernels (0.066 on an AMD Zen 5, too high for
    # the taught turns to be sampled); this way it settles at 0.010-0.014 under each kernel choice of
    # docs/development.md (the floor: the two final turns taught per prompt make one token a coin toss)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: min(1.0, (step + 1) / 5) * 0.5 * (1 + math.cos(math.pi * min(step, steps) / steps))
    )
    model.train()
    for step in range(1, steps + 1):
        log_prob, _ = token_logprobs(model, t, 1.0, with_entropy=False)
        loss = -(log_prob * t["response_mask"]).sum() / t["response_mask"].sum()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        optimizer.zero_grad(set_to_none=True)
        if step % 25 == 0:
            log.info("chat model warm start %d/%d: loss %.4f", step, steps, loss.item())
    return loss.item()


def build_chat_model(folder: Path) -> None:
    """The model, warm-started on `conversations` of the GSM8K and reasoning-gym rows, written to `folder`."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from rl_tpu.models.tiny import save_hf_folder

    tokenizer = chat_tokenizer()
    config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=1,
        num_key_value_heads=1,
        intermediate_size=128,
        max_position_embeddings=512,
        tie_word_embeddings=True,
        bos_token_id=None,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(config).float()
    examples = [example(tokenizer, c) for c in conversations(gsm8k_rows() + reasoning_gym_rows())]
    loss = warm_start(model, tokenizer, examples, WARM_START_STEPS)
    if loss > MAX_WARM_START_LOSS:
        raise RuntimeError(f"the chat model's warm start ended at loss {loss:.3f}: it would not call the tool")
    save_hf_folder(model, tokenizer, folder)
