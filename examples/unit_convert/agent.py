"""A unit-conversion agent: a plain async function over the openai SDK, with one tool that runs right here.

rayrl calls ``solve(task, endpoint)`` once per episode (``rollout.agent:
examples.unit_convert.agent:solve``) and scores the string it returns with ``reward.py``. Nothing in
this file imports rayrl: ``endpoint`` is any object with ``base_url``, ``api_key``, ``model`` (and the
run's ``max_turns``, ``max_tokens``, ``temperature``), ``task`` any object with a ``prompt``.
``agent_program.py`` runs the same loop as a standalone program that reads its endpoint from the
environment (``rollout.agent: command``).
"""

from __future__ import annotations

import json
from typing import Any

from openai import AsyncOpenAI

# metres, kilograms and litres per unit; one table per dimension, so metres never convert to litres
FACTORS: dict[str, tuple[str, float]] = {
    "mm": ("length", 0.001), "cm": ("length", 0.01), "m": ("length", 1.0), "km": ("length", 1000.0),
    "inch": ("length", 0.0254), "foot": ("length", 0.3048), "yard": ("length", 0.9144),
    "mile": ("length", 1609.344),
    "g": ("mass", 0.001), "kg": ("mass", 1.0), "oz": ("mass", 0.028349523125), "lb": ("mass", 0.45359237),
    "ml": ("volume", 0.001), "l": ("volume", 1.0), "cup": ("volume", 0.2365882365),
    "gallon": ("volume", 3.785411784),
}
ALIASES = {
    "millimeter": "mm", "millimeters": "mm", "centimeter": "cm", "centimeters": "cm", "meter": "m",
    "meters": "m", "kilometer": "km", "kilometers": "km", "inches": "inch", "in": "inch", "feet": "foot", "ft": "foot",
    "yards": "yard", "yd": "yard", "miles": "mile", "mi": "mile", "gram": "g", "grams": "g", "kilogram": "kg",
    "kilograms": "kg", "ounce": "oz", "ounces": "oz", "pound": "lb", "pounds": "lb", "lbs": "lb",
    "milliliter": "ml", "milliliters": "ml", "liter": "l", "liters": "l", "litre": "l", "litres": "l",
    "cups": "cup", "gallons": "gallon", "gal": "gallon",
}

TOOLS = [{
    "type": "function",
    "function": {
        "name": "convert",
        "description": "Convert a quantity from one unit to another, e.g. 3 mile to km",
        "parameters": {
            "type": "object",
            "properties": {
                "value": {"type": "number", "description": "the quantity"},
                "from_unit": {"type": "string", "description": "the unit it is in, e.g. mile"},
                "to_unit": {"type": "string", "description": "the unit wanted, e.g. km"},
            },
            "required": ["value", "from_unit", "to_unit"],
        },
    },
}]

SYSTEM_PROMPT = "You convert quantities between units. Call the convert tool, then state the result."

# Two worked exchanges shown before the question: a 135M model copies a shown tool call far more
# reliably than it follows a described format.
EXAMPLES: list[tuple[str, dict[str, Any], str, str]] = [
    ("Convert 2 miles to kilometers.", {"value": 2, "from_unit": "mile", "to_unit": "km"}, "3.219",
     "2 miles is 3.219 kilometers."),
    ("How many grams are in 1.5 pounds?", {"value": 1.5, "from_unit": "lb", "to_unit": "g"}, "680.4",
     "1.5 pounds is 680.4 grams."),
]


def unit(name: str) -> str:
    key = name.strip().lower().rstrip(".")
    return ALIASES.get(key, key)


def convert(value: Any, from_unit: Any, to_unit: Any) -> str:
    """The tool: the converted value with 4 significant digits, or an error the model can read."""
    try:
        number = float(value)
    except (TypeError, ValueError):
        return f"error: value must be a number, got {value!r}"
    src, dst = unit(str(from_unit)), unit(str(to_unit))
    for name, raw in ((src, from_unit), (dst, to_unit)):
        if name not in FACTORS:
            return f"error: unknown unit {raw!r}; known: {', '.join(FACTORS)}"
    if FACTORS[src][0] != FACTORS[dst][0]:
        return f"error: cannot convert {FACTORS[src][0]} ({src}) to {FACTORS[dst][0]} ({dst})"
    return f"{number * FACTORS[src][1] / FACTORS[dst][1]:.4g}"


def call_tool(name: str, raw_arguments: str) -> str:
    if name != "convert":
        return f"error: unknown tool {name!r}; the only tool is convert"
    try:
        arguments = json.loads(raw_arguments or "{}")
    except json.JSONDecodeError:
        return "error: the arguments are not valid JSON"
    if not isinstance(arguments, dict):
        return "error: the arguments must be a JSON object"
    return convert(arguments.get("value"), arguments.get("from_unit"), arguments.get("to_unit"))


def first_messages(question: str) -> list[dict[str, Any]]:
    messages: list[dict[str, Any]] = [{"role": "system", "content": SYSTEM_PROMPT}]
    for n, (asked, arguments, output, answer) in enumerate(EXAMPLES):
        call = {"id": f"call_example_{n}", "type": "function",
                "function": {"name": "convert", "arguments": json.dumps(arguments)}}
        messages += [{"role": "user", "content": asked},
                     {"role": "assistant", "content": "", "tool_calls": [call]},
                     {"role": "tool", "tool_call_id": call["id"], "content": output},
                     {"role": "assistant", "content": answer}]
    return messages + [{"role": "user", "content": question}]


async def run_agent(client: AsyncOpenAI, model: str, question: str, max_turns: int = 4, max_tokens: int = 96,
                    temperature: float = 1.0) -> str:
    """The tool-use loop: ask, run the tool calls here, hand back their output, until a plain answer."""
    messages = first_messages(question)
    for _ in range(max_turns):
        response = await client.chat.completions.create(model=model, messages=messages, tools=TOOLS,
                                                        max_tokens=max_tokens, temperature=temperature)
        message = response.choices[0].message
        if not message.tool_calls:
            return message.content or ""
        calls = [{"id": c.id, "type": "function",
                  "function": {"name": c.function.name, "arguments": c.function.arguments}} for c in message.tool_calls]
        messages.append({"role": "assistant", "content": message.content or "", "tool_calls": calls})
        for c in message.tool_calls:
            output = call_tool(c.function.name, c.function.arguments)
            messages.append({"role": "tool", "tool_call_id": c.id, "content": output})
    return ""  # out of turns without an answer: the reward gives 0


async def solve(task: Any, endpoint: Any) -> str:
    """One episode: the agent rayrl trains (``rollout.agent: examples.unit_convert.agent:solve``)."""
    async with AsyncOpenAI(base_url=endpoint.base_url, api_key=endpoint.api_key) as client:
        return await run_agent(client, endpoint.model, task.prompt, endpoint.max_turns, endpoint.max_tokens,
                               endpoint.temperature)
