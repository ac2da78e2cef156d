"""One tool-schema validator for the three APIs (rayrl/gateway/tools.py): same canonical tools, same
400s naming the field, whichever dialect a tool arrives in."""

from __future__ import annotations

import pytest

from rayrl.gateway.errors import RequestError
from rayrl.gateway.tools import anthropic_tools, chat_tools, responses_tools

SCHEMA = {"type": "object", "properties": {"e": {"type": "string"}}}
CANONICAL = [{"type": "function", "function": {"name": "calc", "description": "evaluate", "parameters": SCHEMA}}]


def test_three_dialects_give_one_canonical_form():
    assert chat_tools([{"type": "function", "function": {"name": "calc", "description": "evaluate",
                                                         "parameters": SCHEMA, "strict": True}}]) == CANONICAL
    assert responses_tools([{"type": "function", "name": "calc", "description": "evaluate", "parameters": SCHEMA},
                            {"type": "web_search"}, {"type": "namespace", "name": "x", "tools": []}]) == CANONICAL
    assert anthropic_tools([{"name": "calc", "description": "evaluate", "input_schema": SCHEMA},
                            {"type": "bash_20250124", "name": "bash"}]) == CANONICAL
    # no parameters: a function without arguments, in every dialect
    empty = {"type": "object", "properties": {}}
    assert chat_tools([{"function": {"name": "now"}}])[0]["function"]["parameters"] == empty
    assert responses_tools([{"type": "function", "name": "now"}])[0]["function"]["parameters"] == empty
    for convert in (chat_tools, responses_tools, anthropic_tools):
        assert convert(None) is None and convert([]) is None


@pytest.mark.parametrize("convert,tools,message", [
    (chat_tools, "calc", "tools must be a list"),
    (chat_tools, [{"type": "web"}], "tools[0] must be an object of type 'function'"),
    (chat_tools, [{"type": "function"}], "tools[0].function must be an object"),
    (chat_tools, [{"type": "function", "function": {"name": ""}}], "tools[0].function.name must be a non-empty"),
    (chat_tools, [CANONICAL[0], {"function": {"name": "f", "parameters": []}}], "tools[1].function.parameters must"),
    (chat_tools, [{"function": {"name": "f", "description": 3}}], "tools[0].function.description must be a string"),
    (responses_tools, [{"name": "f"}], "tools[0] must be an object with a string type"),
    (responses_tools, [{"type": "function", "name": 5}], "tools[0].name must be a non-empty string"),
    (responses_tools, [{"type": "function", "name": "f", "parameters": "x"}], "tools[0].parameters must be an object"),
    (anthropic_tools, ["calc"], "tools[0] must be an object"),
    (anthropic_tools, [{"name": "f"}], "tools[0].input_schema must be an object"),
    (anthropic_tools, [{"input_schema": {}}], "tools[0].name must be a non-empty string"),
])
def test_bad_tools_name_the_field(convert, tools, message):
    with pytest.raises(RequestError) as err:
        convert(tools)
    assert err.value.status == 400 and err.value.param == "tools" and err.value.message.startswith(message)
