"""Tool definitions and ``tool_choice`` of the three wire APIs, validated once, in canonical form.

Each API declares function tools in its own shape (Chat Completions nests them under ``function``,
Responses puts ``name``/``parameters`` on the tool, Anthropic calls the schema ``input_schema``) and
says which tool the model must use in its own words (``"required"`` vs ``{"type": "any"}``). Both
are translated here to one canonical form (OpenAI chat tools and a :class:`ToolChoice`), with one set
of checks, so a bad schema gets the same 400, naming the field, whichever API it came through.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from rayrl.gateway.errors import RequestError

_EMPTY_SCHEMA = {"type": "object", "properties": {}}


@dataclass(frozen=True)
class ToolChoice:
    """Which tool calls a turn may or must make.

    ``mode``: ``auto`` (the model decides), ``none`` (tools hidden), ``required`` (some call) or
    ``function`` (a call of ``name``). ``parallel`` False allows at most one call per turn.
    """

    mode: str = "auto"
    name: str | None = None
    parallel: bool = True

    @property
    def forces_call(self) -> bool:
        return self.mode in ("required", "function")


AUTO = ToolChoice()


def _function_tool(fields: dict[str, Any], where: str, schema_key: str, schema_required: bool) -> dict[str, Any]:
    """One function tool in canonical shape; ``where`` names the object holding ``fields``."""
    name, description, schema = fields.get("name"), fields.get("description"), fields.get(schema_key)
    if not isinstance(name, str) or not name:
        raise RequestError(f"{where}.name must be a non-empty string", param="tools")
    if description is not None and not isinstance(description, str):
        raise RequestError(f"{where}.description must be a string", param="tools")
    if (schema is not None or schema_required) and not isinstance(schema, dict):
        raise RequestError(f"{where}.{schema_key} must be an object (a JSON schema)", param="tools")
    fn: dict[str, Any] = {"name": name}
    if description:
        fn["description"] = description
    fn["parameters"] = schema or dict(_EMPTY_SCHEMA)
    return {"type": "function", "function": fn}


def _tool_list(raw: Any) -> list[Any] | None:
    if raw is None:
        return None
    if not isinstance(raw, list):
        raise RequestError("tools must be a list", param="tools")
    return raw


def chat_tools(raw: Any) -> list[dict[str, Any]] | None:
    """Chat Completions ``tools`` (``{"type": "function", "function": {...}}``); None when absent or empty."""
    out = []
    for i, tool in enumerate(_tool_list(raw) or []):
        if not isinstance(tool, dict) or tool.get("type", "function") != "function":
            raise RequestError(f"tools[{i}] must be an object of type 'function'", param="tools")
        fn = tool.get("function")
        if not isinstance(fn, dict):
            raise RequestError(f"tools[{i}].function must be an object", param="tools")
        out.append(_function_tool(fn, f"tools[{i}].function", "parameters", schema_required=False))
    return out or None


def responses_tools(raw: Any) -> list[dict[str, Any]] | None:
    """Responses API function tools; other types (namespace, web_search, custom, mcp...) are skipped:
    the model cannot call them through this gateway."""
    out = []
    for i, tool in enumerate(_tool_list(raw) or []):
        if not isinstance(tool, dict) or not isinstance(tool.get("type"), str):
            raise RequestError(f"tools[{i}] must be an object with a string type", param="tools")
        if tool["type"] == "function":
            out.append(_function_tool(tool, f"tools[{i}]", "parameters", schema_required=False))
    return out or None


def anthropic_tools(raw: Any) -> list[dict[str, Any]] | None:
    """Anthropic client tools (``name``, ``input_schema``); server tools (any other ``type``) run at
    Anthropic, not here, and are skipped."""
    out = []
    for i, tool in enumerate(_tool_list(raw) or []):
        if not isinstance(tool, dict):
            raise RequestError(f"tools[{i}] must be an object", param="tools")
        if tool.get("type") in (None, "custom"):
            out.append(_function_tool(tool, f"tools[{i}]", "input_schema", schema_required=True))
    return out or None


# -- tool_choice ----------------------------------------------------------------------------------


def _choice_error(expected: str) -> RequestError:
    return RequestError(f"tool_choice must be {expected}", param="tool_choice")


def _parallel(value: Any, key: str) -> bool:
    if value is None:
        return True
    if not isinstance(value, bool):
        raise RequestError(f"{key} must be a boolean", param=key)
    return value


def _named(name: Any, where: str) -> str:
    if not isinstance(name, str) or not name:
        raise RequestError(f"{where} must be a non-empty string", param="tool_choice")
    return name


_OPENAI_FORMS = "'none', 'auto', 'required' or {{\"type\": \"function\", {}}}"
_OPENAI_NAMED = {True: '\"function\": {\"name\": ...}', False: '\"name\": ...'}  # by ``nested``
_ANTHROPIC_FORMS = "an object with type 'auto', 'any', 'tool' (with a name) or 'none'"


def _openai_tool_choice(body: dict[str, Any], nested: bool) -> ToolChoice:
    """OpenAI ``tool_choice`` and ``parallel_tool_calls``; a named function is
    ``{"type": "function", "function": {"name"}}`` in Chat Completions (``nested``) and
    ``{"type": "function", "name"}`` in Responses. Choices of other tool types (hosted tools,
    ``allowed_tools``, ``custom``) are refused: only function tools are callable here."""
    raw, parallel = body.get("tool_choice"), _parallel(body.get("parallel_tool_calls"), "parallel_tool_calls")
    if raw is None:
        return ToolChoice(parallel=parallel)
    if isinstance(raw, str) and raw in ("none", "auto", "required"):
        return ToolChoice(raw, parallel=parallel)
    if isinstance(raw, dict) and raw.get("type") == "function":
        holder = raw.get("function") if nested else raw
        if not isinstance(holder, dict):
            raise _choice_error(_OPENAI_FORMS.format(_OPENAI_NAMED[nested]))
        where = "tool_choice.function.name" if nested else "tool_choice.name"
        return ToolChoice("function", _named(holder.get("name"), where), parallel)
    if isinstance(raw, dict) and isinstance(raw.get("type"), str):
        raise RequestError(f"tool_choice type {raw['type']!r} is not supported here: only function tools "
                           "can be called through this gateway", param="tool_choice")
    raise _choice_error(_OPENAI_FORMS.format(_OPENAI_NAMED[nested]))


def chat_tool_choice(body: dict[str, Any]) -> ToolChoice:
    return _openai_tool_choice(body, nested=True)


def responses_tool_choice(body: dict[str, Any]) -> ToolChoice:
    return _openai_tool_choice(body, nested=False)


def anthropic_tool_choice(body: dict[str, Any]) -> ToolChoice:
    """Anthropic ``tool_choice`` (``auto``/``any``/``tool``/``none``, ``disable_parallel_tool_use``)."""
    raw = body.get("tool_choice")
    if raw is None:
        return AUTO
    if not isinstance(raw, dict) or raw.get("type") not in ("auto", "any", "tool", "none"):
        raise _choice_error(_ANTHROPIC_FORMS)
    disable = raw.get("disable_parallel_tool_use")
    if disable is not None and not isinstance(disable, bool):
        raise RequestError("tool_choice.disable_parallel_tool_use must be a boolean", param="tool_choice")
    parallel = not disable
    kind = raw["type"]
    if kind == "tool":
        return ToolChoice("function", _named(raw.get("name"), "tool_choice.name"), parallel)
    return ToolChoice({"any": "required"}.get(kind, kind), parallel=parallel)


def apply_tool_choice(tools: list[dict[str, Any]] | None, choice: ToolChoice) -> list[dict[str, Any]] | None:
    """The tools the model sees under ``choice`` (None for ``none``); 400 when a choice that forces a
    call has no tools, or names a function that is not among them."""
    if choice.mode == "none":
        return None
    if choice.forces_call and not tools:
        raise RequestError(f"tool_choice {choice.mode!r} needs tools, and this request has none "
                           "(only function tools count)", param="tool_choice")
    if choice.mode == "function" and all(t["function"]["name"] != choice.name for t in tools or []):
        names = ", ".join(t["function"]["name"] for t in tools or [])
        raise RequestError(f"tool_choice names function {choice.name!r}, which is not among the tools ({names})",
                           param="tool_choice")
    return tools
