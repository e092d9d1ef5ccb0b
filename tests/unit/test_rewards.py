"""Built-in rewards as plain verl-signature functions: arithmetic, gsm8k, math (math-verify), format."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO
from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse, verify

from rewards import arithmetic, gsm8k
from rewards import format as format_reward
from rewards import math as math_reward

GSM8K_TEST = REPO.parent / "shared" / "data" / "gsm8k" / "test.jsonl"
GSM8K_FIXTURE = REPO / "tests" / "fixtures" / "gsm8k" / "test.jsonl"


@pytest.mark.parametrize(
    "completion, truth, expected",
    [
        (" 42", "42", 1.0),
        (" -7 and more", "-7", 1.0),
        (" 41", "42", 0.0),
        ("", "3", 0.0),
        (" 4 2", "42", 0.0),
        (" 042", "42", 1.0),
        (" 12 13", "13", 0.0),
        # episodes with the calculator: the answer follows the last tool result; calls are not answers
        (' <tool_call>{"expression": "47*1"}</tool_call>\n<tool_response>\n47\n</tool_response>\n 47', "47", 1.0),
        (' <tool_call>{"expression": "47*1"}</tool_call>\n<tool_response>\n47\n</tool_response>\n 46', "47", 0.0),
        (' <tool_call>{"expression": "47*1"}</tool_call>', "47", 0.0),
        (' <tool_call>{"expression": "47*1"', "47", 0.0),
    ],
)
def test_arithmetic_reward_reads_the_first_integer(completion, truth, expected):
    assert arithmetic.compute_score("rl_tpu/arithmetic", completion, truth) == expected


def gsm8k_rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def verl_ground_truth(solution: str) -> str:
    """What verl's GSM8K preprocessing stores as reward_model.ground_truth."""
    return solution.split("#### ")[1].replace(",", "").strip()


def perturbed(solution: str) -> str:
    """The same solution with its final answer changed by one."""
    head, answer = solution.rsplit("#### ", 1)
    return f"{head}#### {int(answer.replace(',', '')) + 1}"


def check_gold_solutions(rows: list[dict]) -> None:
    for index, row in enumerate(rows):
        truth = verl_ground_truth(row["answer"])
        assert gsm8k.compute_score("openai/gsm8k", row["answer"], truth) == 1.0, (index, row["answer"][-80:])
        assert gsm8k.compute_score("openai/gsm8k", perturbed(row["answer"]), truth) == 0.0, index


def test_gsm8k_gold_solutions_score_one_and_perturbed_zero_fixture():
    rows = gsm8k_rows(GSM8K_FIXTURE)
    assert len(rows) == 8
    check_gold_solutions(rows)


@pytest.mark.skipif(not GSM8K_TEST.exists(), reason=f"{GSM8K_TEST} is not on this machine")
def test_gsm8k_gold_solutions_score_one_and_perturbed_zero_full_test_set():
    rows = gsm8k_rows(GSM8K_TEST)
    assert len(rows) == 1319
    check_gold_solutions(rows)


@pytest.mark.parametrize(
    "completion, truth, expected",
    [
        ("She makes 9 * 2 = $18 every day.\n#### 18", "18", 1.0),
        ("#### $1,200", "1200", 1.0),  # dollar sign and thousands separator
        ("The total is 1,200 dollars.", "1200", 1.0),  # no ####: the last number, units dropped
        ("#### 18.0", "18", 1.0),
        ("#### 18.50", "18.5", 1.0),
        ("#### 18 eggs\nThat was easy, 3 times over.", "18", 1.0),  # the number after ####, not the last
        ("#### -3", "-3", 1.0),
        ("#### 17", "18", 0.0),
        ("I do not know.", "18", 0.0),
        ("3 + 4 = 7", "Step 1 ... #### 7", 1.0),  # a whole GSM8K solution as the ground truth
    ],
)
def test_gsm8k_reward_tolerates_answer_formatting(completion, truth, expected):
    assert gsm8k.compute_score("openai/gsm8k", completion, truth) == expected


def test_gsm8k_reward_agrees_with_verl_on_verl_formatted_answers():
    from verl.utils.reward_score import gsm8k as verl_gsm8k

    for row in gsm8k_rows(GSM8K_FIXTURE):
        truth = verl_ground_truth(row["answer"])
        for completion in (row["answer"], perturbed(row["answer"]), "no answer"):
            ours = gsm8k.compute_score("openai/gsm8k", completion, truth)
            assert ours == float(verl_gsm8k.compute_score(completion, truth)), completion[-60:]


# (reference answer, model answer, mathematically equal)
LATEX_PAIRS = [
    ("\\frac{1}{2}", "0.5", True),
    ("\\frac{1}{2}", "\\dfrac{1}{2}", True),
    ("\\frac{1}{2}", "1/2", True),
    ("\\frac{3}{4}", "0.75", True),
    ("\\frac{3}{4}", "0.74", False),
    ("-\\frac{1}{3}", "-1/3", True),
    ("\\frac{1}{6}", "\\frac{2}{12}", True),
    ("\\frac{\\sqrt{2}}{2}", "\\sqrt{2}/2", True),
    ("\\frac{\\sqrt{2}}{2}", "\\frac{1}{\\sqrt{2}}", True),
    ("\\sqrt{8}", "2\\sqrt{2}", True),
    ("\\sqrt{8}", "3\\sqrt{2}", False),
    ("(0,1]", "(0,1]", True),
    ("(0,1]", "[0,1]", False),
    ("[0,1)", "(0,1)", False),
    ("(-\\infty, 3)", "(-\\infty,3)", True),
    ("(-\\infty, 3)", "(-\\infty,3]", False),
    ("\\{1,2\\}", "\\{2,1\\}", True),
    ("\\{1,2\\}", "\\{1,3\\}", False),
    ("(1,2)", "(2,1)", False),
    ("3", "3.0", True),
    ("3", "4", False),
    ("1,000", "1000", True),
    ("\\pi", "3.14", False),
    ("2\\pi", "\\pi \\cdot 2", True),
    ("x^2+2x+1", "(x+1)^2", True),
    ("x^2+1", "(x+1)^2", False),
    ("a+b", "b+a", True),
    ("\\log_2 8", "3", True),
    ("90^\\circ", "90", True),
    ("\\text{(B)}", "B", True),
    ("\\infty", "-\\infty", False),
    ("\\begin{pmatrix}1\\\\2\\end{pmatrix}", "\\begin{pmatrix}1\\\\2\\end{pmatrix}", True),
    ("\\begin{pmatrix}1\\\\2\\end{pmatrix}", "\\begin{pmatrix}2\\\\1\\end{pmatrix}", False),
]


def math_verify_says(reference: str, answer: str) -> bool:
    gold = parse(f"\\boxed{{{reference}}}", (LatexExtractionConfig(),))
    predicted = parse(f"\\boxed{{{answer}}}", (LatexExtractionConfig(), ExprExtractionConfig()))
    return bool(gold and predicted and verify(gold, predicted))


@pytest.mark.parametrize("reference, answer, equal", LATEX_PAIRS)
def test_math_reward_agrees_with_math_verify(reference, answer, equal):
    completion = f"Step by step ... so the answer is $\\boxed{{{answer}}}$."
    score = math_reward.compute_score("DigitalLearningGmbH/MATH-lighteval", completion, reference)
    assert score == float(equal) == float(math_verify_says(reference, answer))


def test_math_table_is_large_and_balanced():
    assert len(LATEX_PAIRS) >= 30
    assert 10 <= sum(equal for *_, equal in LATEX_PAIRS) <= len(LATEX_PAIRS) - 10


@pytest.mark.parametrize(
    "completion, expected",
    [
        ("\\boxed{1} first, then I changed my mind: \\boxed{\\frac{1}{2}}", 1.0),  # the last box counts
        ("\\boxed{\\frac{1}{2}} first, then \\boxed{3}", 0.0),
        ("No box, but the final answer is $\\frac{1}{2}$.", 1.0),  # math-verify finds the final answer
        ("\\boxed{\\frac{1}{2", 0.0),
        ("", 0.0),
    ],
)
def test_math_reward_reads_the_last_box_or_the_final_answer(completion, expected):
    assert math_reward.compute_score("math", completion, "0.5") == expected


def test_last_boxed_matches_braces():
    assert math_reward.last_boxed("a \\boxed{\\frac{1}{2}} b \\fbox{x^{2}}") == "x^{2}"
    assert math_reward.last_boxed("no box") is None and math_reward.last_boxed("\\boxed{open") is None


@pytest.mark.parametrize(
    "completion, expected",
    [
        ("so \\boxed{42}", 1.0),
        ("#### 42", 1.0),
        ("#### $1,200", 1.0),
        ("\\boxed{}", 0.0),
        ("####", 0.0),
        ("the answer is 42", 0.0),
    ],
)
def test_format_reward(completion, expected):
    assert format_reward.compute_score("any", completion, "42") == expected


def test_reward_modules_import_alone_and_load_as_verl_plugins():
    """Each module needs neither rl_tpu nor torch nor Ray, and loads from its file path the way verl does."""
    script = (
        "import importlib.util, sys\n"
        "for name in ['arithmetic', 'gsm8k', 'math', 'format']:\n"
        "    spec = importlib.util.spec_from_file_location('custom_module', f'rewards/{name}.py')\n"
        "    module = importlib.util.module_from_spec(spec); spec.loader.exec_module(module)\n"
        "    assert module.compute_score(data_source='x', solution_str='#### 7 \\\\boxed{7}', ground_truth='7',"
        " extra_info=None) == 1.0, name\n"
        "loaded = {m.split('.')[0] for m in sys.modules}\n"
        "assert not loaded & {'rl_tpu', 'torch', 'ray', 'vllm'}, loaded & {'rl_tpu', 'torch', 'ray', 'vllm'}\n"
    )
    result = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
