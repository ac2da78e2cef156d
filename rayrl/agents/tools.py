"""What a tool is (a schema, demos, a call that runs in the episode's sandbox), and the calculator tool.

The registry of tools by name is rayrl/agents/toolbox.py; file tools are rayrl/agents/file_tools.py.
"""

from __future__ import annotations

import json
import random
from abc import ABC, abstractmethod
from typing import Any, Sequence

from rayrl.sandboxes.base import Sandbox

# A safe arithmetic evaluator, written into the sandbox. It parses with `ast` and allows only numbers,
# + - * / // % ** (small exponents) and parentheses, so a tool call cannot run arbitrary code even
# before the sandbox's own isolation applies.
CALC_SCRIPT = r'''
import ast, operator, sys
OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
       ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow,
       ast.USub: operator.neg, ast.UAdd: operator.pos}
def ev(node):
    if isinstance(node, ast.Expression):
        return ev(node.body)
    if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) and not isinstance(node.value, bool):
        return node.value
    if isinstance(node, ast.BinOp) and type(node.op) in OPS:
        left, right = ev(node.left), ev(node.right)
        if isinstance(node.op, ast.Pow) and abs(right) > 64:
            raise ValueError("exponent too large")
        return OPS[type(node.op)](left, right)
    if isinstance(node, ast.UnaryOp) and type(node.op) in OPS:
        return OPS[type(node.op)](ev(node.operand))
    raise ValueError("only numbers, + - * / // % ** and parentheses are allowed")
expr = sys.argv[1] if len(sys.argv) > 1 else ""
if len(sys.argv) > 2:  # a slow tool, on purpose: the sandbox process takes this long (seconds)
    import time; time.sleep(min(float(sys.argv[2]), 60.0))
if len(expr) > 200:
    print("error: expression too long"); sys.exit(1)
try:
    value = ev(ast.parse(expr.replace("^", "**").replace("x", "*"), mode="eval"))
except ZeroDivisionError:
    print("error: division by zero"); sys.exit(1)
except Exception as err:
    print("error: " + str(err)[:200]); sys.exit(1)
if isinstance(value, float) and value.is_integer():
    value = int(value)
print(round(value, 6) if isinstance(value, float) else value)
'''


class Tool(ABC):
    """A function the model can call: an OpenAI schema plus how to run it in a sandbox."""

    name: str
    description: str
    parameters: dict[str, Any]

    def schema(self) -> dict[str, Any]:
        return {
            "type": "function",
            "function": {"name": self.name, "description": self.description, "parameters": self.parameters},
        }

    # Worked examples for in-context demonstrations: (question, [(tool name, arguments, tool output), ...],
    # final answer). Several calls show a multi-step task (look, then read, then answer).
    demos: list[tuple[str, list[tuple[str, dict[str, Any], str]], str]] = []

    def __init__(self, delay_s: Sequence[float] = ()) -> None:
        self.delay_s = tuple(float(d) for d in delay_s)  # (min, max) extra seconds per call; () none

    def setup(self, sandbox: Sandbox | None) -> None:
        """Prepare the sandbox (write helper files) before the episode's first call; a tool with nothing to
        prepare keeps this default, which does nothing (so not abstract)."""
        return None

    @abstractmethod
    def call(self, sandbox: Sandbox | None, arguments: dict[str, Any]) -> tuple[str, bool]:
        """Run the tool; returns (output shown to the model, ok)."""


class CalculatorTool(Tool):
    """Evaluates an arithmetic expression inside the sandbox."""

    name = "calculator"
    description = "Evaluate an arithmetic expression, e.g. (12+7)*3"
    parameters = {
        "type": "object",
        "properties": {"expression": {"type": "string", "description": "arithmetic expression"}},
        "required": ["expression"],
    }
    script_path = "calc.py"
    demos = [
        ("What is 12 * 7?", [("calculator", {"expression": "12 * 7"}, "84")], "The answer is 84."),
        ("What is (3 + 5) * 9?", [("calculator", {"expression": "(3 + 5) * 9"}, "72")], "The answer is 72."),
        ("What is 40 - 13?", [("calculator", {"expression": "40 - 13"}, "27")], "The answer is 27."),
    ]
    timeout_s = 10.0

    def setup(self, sandbox: Sandbox | None) -> None:
        if sandbox is None:
            raise RuntimeError("the calculator tool needs a sandbox")
        sandbox.write_file(self.script_path, CALC_SCRIPT.encode())

    def call(self, sandbox: Sandbox | None, arguments: dict[str, Any]) -> tuple[str, bool]:
        expr = arguments.get("expression")
        if not isinstance(expr, str) or not expr.strip():
            return "error: 'expression' must be a non-empty string", False
        assert sandbox is not None
        argv = ["python3", self.script_path, expr]
        delay = random.uniform(*self.delay_s) if self.delay_s else 0.0
        if delay > 0:
            argv.append(f"{delay:.3f}")
        result = sandbox.exec(argv, timeout=self.timeout_s + delay)
        if result.timed_out:
            return "error: the calculation timed out", False
        out = (result.stdout or result.stderr).strip()[:500]
        return out, result.exit_code == 0


def parse_arguments(raw: str) -> dict[str, Any]:
    """Tool-call arguments as a dict; raises ValueError with a message the model can read."""
    try:
        args = json.loads(raw) if raw else {}
    except json.JSONDecodeError as err:
        raise ValueError(f"arguments are not valid JSON ({err.msg})") from None
    if not isinstance(args, dict):
        raise ValueError("arguments must be a JSON object")
    return args
