"""A calculator tool written against verl's tool API as a `BaseTool` subclass, named in calculator.yaml
(`episode.tools_config_file`); calc_function.py is the same as a verl `@function_tool` (`episode.function_tool_path`).

It evaluates +, -, * and / over integers and parentheses; anything else is an error the model reads.
"""

from __future__ import annotations

import ast
import operator
from typing import Any

from verl.tools.base_tool import BaseTool
from verl.tools.schemas import ToolResponse

OPERATORS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv}
MAX_DIGITS = 30  # a result longer than this is refused: no exponent towers through repeated products


def evaluate(expression: str) -> str:
    """The value of an arithmetic expression as text (an integer when it is one)."""

    def value(node: ast.AST) -> float:
        if isinstance(node, ast.Constant) and type(node.value) is int:
            return node.value
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            return -value(node.operand)
        if isinstance(node, ast.BinOp):
            if type(node.op) not in OPERATORS:
                raise ValueError(f"unsupported operator {type(node.op).__name__}: use + - * /")
            result = OPERATORS[type(node.op)](value(node.left), value(node.right))
            if len(str(int(result))) > MAX_DIGITS:
                raise ValueError("result too large")
            return result
        raise ValueError(f"unsupported expression element {type(node).__name__}")

    result = value(ast.parse(expression.strip(), mode="eval").body)
    return str(int(result)) if float(result).is_integer() else f"{result:.6g}"


class CalculatorTool(BaseTool):
    """verl's stateful form: `create`, `execute`, `calc_reward`, `release` (the base class's defaults for the
    others). `calc_reward` is 0: the answer's correctness is the reward plugin's to judge."""

    async def execute(self, instance_id: str, parameters: dict[str, Any], **kwargs) -> tuple[ToolResponse, float, dict]:
        try:
            return ToolResponse(text=evaluate(str(parameters.get("expression", "")))), 0.0, {}
        except (ValueError, SyntaxError, ZeroDivisionError) as err:
            return ToolResponse(text=f"error: {err}"), 0.0, {}
