"""The calculator as a verl `@function_tool` (`episode.function_tool_path=examples/tools/calc_function.py`): verl
builds its schema from the type hints and the docstring. A function tool and a tools YAML may be used together
as long as their tool names differ (verl refuses duplicates); this one is `calc`, the YAML's is `calculator`."""

from __future__ import annotations

from calculator import evaluate  # a tool file's folder is on the tool workers' import path
from verl.tools.function_tool import function_tool


@function_tool("calc")
def calc(expression: str) -> str:
    """Evaluate an arithmetic expression.

    Args:
        expression: integers with + - * / and parentheses, e.g. "37*48"
    """
    try:
        return evaluate(expression)
    except (ValueError, SyntaxError, ZeroDivisionError) as err:
        return f"error: {err}"
