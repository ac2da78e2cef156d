"""Chat messages -> prompt token ids, with the model's own chat template.

Two jobs: normalise whatever a client sends into one canonical OpenAI message shape (so that routing
compares like with like), and render a prompt. When a request's history equals a recorded turn's
history plus its response, :meth:`ChatRenderer.extend` builds the prompt from that turn's exact tokens
plus the new messages' tokens (cumulative token mode), so re-tokenising the model's own output can
never drift, not even under templates that render history without the reasoning the model sampled
(Qwen3, DeepSeek: rayrl/gateway/families.py).

A token limit bounds the work a huge request can cause: with ``limit``, a long text is tokenized a
chunk at a time and refused (:class:`PromptTooLong`, with a lower bound of its length) as soon as the
chunks prove it longer than the limit. A 20 MB message against an 8K context costs one 64K-character
chunk, not the 14 s of tokenizing it all.
"""

from __future__ import annotations

import json
import logging
from typing import Any

import numpy as np

from rayrl.gateway.errors import RequestError
from rayrl.gateway.parsers import ToolParser
from rayrl.gateway.prompt_tokens import PromptTokenizer
from rayrl.types import TurnRecord

logger = logging.getLogger(__name__)

_ROLES = {"system", "user", "assistant", "tool"}
_PROBE = "\u2063rayrl-probe\u2063"
CHUNK_CHARS = 65536  # texts longer than two chunks are counted chunk by chunk against a limit first
CHUNK_SLACK_TOKENS = 64  # tokens a cut between chunks may add: a count proves "too long" only past them


_LOOP_NUMBERS = frozenset({"first", "last", "index", "index0", "revindex", "revindex0", "length", "depth", "depth0"})


def _with_loop_reads(template: Any, source: str) -> Any:
    """``template`` compiled again in an overlay of its sandboxed environment whose ``getattr`` reads the
    numbers of jinja's own ``loop`` object (``loop.first``, ``loop.index``, ...) directly.

    Why: chat templates read ``loop.first``/``loop.last`` once per message, and the sandbox checks every
    attribute read (is it private, internal, a mutating method of a known mutable type: a dozen calls,
    abc ``isinstance`` checks among them), on every render, twice per call in cumulative token mode. Those
    checks pass for these attributes of a ``LoopContext`` whatever the template (no underscore, not a
    function, frame or code object, not a list, dict or set method), and the values are numbers and
    booleans, never a ``str.format`` the sandbox would wrap, so the answer is the same without them. Every
    other read goes through the sandbox as before. The environment is transformers' (shared with
    ``apply_chat_template``): it is overlaid, not changed. On anything unexpected the template is returned
    as it was."""
    try:
        from jinja2.runtime import LoopContext

        env = template.environment.overlay()
        checked = env.getattr

        def getattr_(obj: Any, attribute: str) -> Any:
            if type(obj) is LoopContext and attribute in _LOOP_NUMBERS:
                try:
                    return getattr(obj, attribute)
                except AttributeError:
                    pass
            return checked(obj, attribute)

        env.getattr = getattr_
        return env.from_string(source)
    except Exception as err:  # the template as it was: same output, the sandbox's checks on every read
        logger.warning("chat template: loop reads stay fully sandboxed (%s: %s)", type(err).__name__, err)
        return template


class PromptTooLong(Exception):
    """A text has at least ``at_least`` tokens, more than the limit it was tokenized against; exactly
    that many when ``exact`` (it was tokenized in full)."""

    def __init__(self, at_least: int, exact: bool = False) -> None:
        super().__init__(f"{'' if exact else 'at least '}{at_least} tokens")
        self.at_least, self.exact = at_least, exact


def _text_of(content: Any, where: str) -> str:
    """Text of an OpenAI content field: a string, null, or a list of text parts."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for i, part in enumerate(content):
            if isinstance(part, str):
                parts.append(part)
            elif isinstance(part, dict) and part.get("type") in ("text", "input_text", "output_text"):
                text = part.get("text")
                if not isinstance(text, str):
                    raise RequestError(f"{where}.content[{i}].text must be a string")
                parts.append(text)
            else:
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise RequestError(f"{where}.content[{i}]: unsupported content part {kind!r}")
        return "".join(parts)
    raise RequestError(f"{where}.content must be a string, null or a list of parts")


def _canonical_tool_calls(calls: Any, where: str) -> list[dict[str, Any]]:
    if not isinstance(calls, list):
        raise RequestError(f"{where}.tool_calls must be a list")
    out = []
    for i, call in enumerate(calls):
        if not isinstance(call, dict) or not isinstance(call.get("function"), dict):
            raise RequestError(f"{where}.tool_calls[{i}] must be an object with a 'function' object")
        fn = call["function"]
        name = fn.get("name")
        if not isinstance(name, str) or not name:
            raise RequestError(f"{where}.tool_calls[{i}].function.name must be a non-empty string")
        args = fn.get("arguments", "{}")
        if not isinstance(args, str):
            args = json.dumps(args, ensure_ascii=False)
        call_id = call.get("id")
        out.append(
            {
                "id": call_id if isinstance(call_id, str) else "",
                "type": "function",
                "function": {"name": name, "arguments": args},
            }
        )
    return out


def normalize_message(msg: Any, index: int) -> dict[str, Any]:
    """One message in canonical OpenAI shape: role, content (str), and tool fields only when present."""
    where = f"messages[{index}]"
    if not isinstance(msg, dict):
        raise RequestError(f"{where} must be an object")
    role = msg.get("role")
    if not isinstance(role, str):
        raise RequestError(f"{where}.role must be a string")
    if role == "developer":
        role = "system"
    if role not in _ROLES:
        raise RequestError(f"{where}.role must be one of system, developer, user, assistant, tool")
    out: dict[str, Any] = {"role": role, "content": _text_of(msg.get("content"), where)}
    if role == "assistant" and msg.get("tool_calls"):
        out["tool_calls"] = _canonical_tool_calls(msg["tool_calls"], where)
    if role == "tool":
        call_id = msg.get("tool_call_id", "")
        if not isinstance(call_id, str):
            raise RequestError(f"{where}.tool_call_id must be a string")
        out["tool_call_id"] = call_id
    name = msg.get("name")
    if isinstance(name, str) and name:
        out["name"] = name
    return out


def normalize_messages(messages: Any) -> list[dict[str, Any]]:
    if not isinstance(messages, list) or not messages:
        raise RequestError("messages must be a non-empty list", param="messages")
    return [normalize_message(m, i) for i, m in enumerate(messages)]


def _with_argument_objects(msg: dict[str, Any]) -> dict[str, Any]:
    """``msg`` with tool-call arguments as JSON objects, not strings (a copy; the canonical message is
    recorded as is). Chat templates that render tool calls (Qwen2.5, Llama 3.1) write
    ``arguments | tojson``: a string would come out JSON-encoded twice, a form the model never saw."""
    calls = msg.get("tool_calls")
    if not calls:
        return msg
    out = []
    for call in calls:
        args = call["function"]["arguments"]
        try:
            parsed = json.loads(args) if isinstance(args, str) else args
        except json.JSONDecodeError:
            parsed = args
        if not isinstance(parsed, dict):
            parsed = args
        out.append({**call, "function": {**call["function"], "arguments": parsed}})
    return {**msg, "tool_calls": out}


def fold_late_system_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """System messages after the first message merged into a leading system message (the same list
    object when there are none)."""
    late = [i for i, m in enumerate(messages) if m["role"] == "system" and i > 0]
    if not late:
        return messages
    extra = "\n\n".join(messages[i]["content"] for i in late)
    rest = [m for i, m in enumerate(messages) if i not in set(late)]
    if rest and rest[0]["role"] == "system":
        return [{**rest[0], "content": rest[0]["content"] + "\n\n" + extra}] + rest[1:]
    return [{"role": "system", "content": extra}] + rest


class ChatRenderer:
    """Renders canonical messages with the tokenizer's chat template.

    Chat templates that know nothing about tools (SmolLM2's, for one) would drop tool calls and tool
    schemas; for those the renderer writes assistant tool calls as the text the parser reads and, if
    ``inject_tool_schemas``, describes the tools in the system message.
    """

    def __init__(
        self,
        tokenizer: Any,
        tool_parser: ToolParser,
        chat_template: str | None = None,
        inject_tool_schemas: bool = True,
    ) -> None:
        self.tokenizer = tokenizer
        self.tool_parser = tool_parser
        self.chat_template = chat_template
        self.inject_tool_schemas = inject_tool_schemas
        source = chat_template or getattr(tokenizer, "chat_template", None) or ""
        if not source:
            raise ValueError("the tokenizer has no chat template; set model.chat_template")
        self.supports_tools = "tools" in source
        self.supports_tool_calls = "tool_calls" in source
        self._assistant_tail = self._probe_assistant_tail()
        self._end_ids = self._end_token_ids()
        self._direct = self._direct_template()
        self._tokens = PromptTokenizer(tokenizer)

    # -- rendering ---------------------------------------------------------------------------------

    def _template_messages(self, messages: list[dict[str, Any]], tools: list | None) -> list[dict[str, Any]]:
        if self.supports_tool_calls and (self.supports_tools or not tools):
            return [_with_argument_objects(m) for m in messages]
        out = []
        for msg in messages:
            if msg["role"] == "assistant" and msg.get("tool_calls") and not self.supports_tool_calls:
                calls = self.tool_parser.format_tool_calls(msg["tool_calls"])
                text = f"{msg['content']}\n{calls}" if msg["content"] else calls
                msg = {"role": "assistant", "content": text}
            out.append(msg)
        if tools and not self.supports_tools and self.inject_tool_schemas:
            block = self.tool_parser.tools_system_prompt(tools)
            if block:
                if out and out[0]["role"] == "system":
                    out[0] = {**out[0], "content": out[0]["content"] + block}
                else:
                    out.insert(0, {"role": "system", "content": block.lstrip()})
        return out

    def _apply_template(self, messages: list[dict[str, Any]], tools: list | None, add_generation_prompt: bool) -> str:
        """``tokenizer.apply_chat_template(..., tokenize=False)``; through :attr:`_direct` when it renders
        the same (it skips the per-call work around the template: the special-tokens map is rebuilt on
        every call there, a third of a short prompt's render time)."""
        if self._direct is not None:
            return self._direct(messages, tools, add_generation_prompt)
        kwargs: dict[str, Any] = {"tokenize": False, "add_generation_prompt": add_generation_prompt}
        if self.chat_template:
            kwargs["chat_template"] = self.chat_template
        if tools:
            kwargs["tools"] = tools
        return self.tokenizer.apply_chat_template(messages, **kwargs)

    def _direct_template(self) -> Any:
        """A function that renders as ``apply_chat_template(tokenize=False)`` does (the same compiled
        template, variables and special tokens), or None when transformers' template compiler cannot
        be reached or a probe renders differently.

        It also skips jinja's per-render merge of the template's globals: ``Template.render`` flattens
        the globals' ChainMap into the new context's dict twice per call (pure-Python ChainMap walks,
        half of a short prompt's render time); here they are flattened once per template and each
        render builds the same context from the flat copy."""
        try:
            from transformers.utils.chat_template_utils import _compile_jinja_template
        except ImportError:
            return None
        tokenizer, chosen = self.tokenizer, self.chat_template
        try:
            special = dict(tokenizer.special_tokens_map)
        except Exception:
            return None
        compiled: dict[bool, tuple[Any, Any, dict[str, Any], dict[str, Any]]] = {}

        def template_for(with_tools: bool) -> tuple[Any, Any, dict[str, Any], dict[str, Any]]:
            """(template, environment, flat globals, globals + special tokens), per with/without tools (a
            tokenizer with several templates picks its ``tool_use`` one for calls with tools)."""
            entry = compiled.get(with_tools)
            if entry is None:
                source = tokenizer.get_chat_template(chosen, [{}] if with_tools else None)
                template = _with_loop_reads(_compile_jinja_template(source), source)
                flat = dict(template.globals)
                entry = (template, template.environment, flat, {**flat, **special})
                compiled[with_tools] = entry
            return entry

        def render(messages: list[dict[str, Any]], tools: list | None, add_generation_prompt: bool) -> str:
            # as Template.render(messages=..., tools=..., documents=None, add_generation_prompt=..., **special)
            template, env, flat, base = template_for(bool(tools))
            context = env.context_class(
                env, {**base, "messages": messages, "tools": tools or None, "documents": None,
                      "add_generation_prompt": add_generation_prompt},
                template.name, template.blocks, globals=flat)
            try:
                return env.concat(template.root_render_func(context))
            except Exception:
                env.handle_exception()  # raises the template's error, as Template.render does
                raise

        probe = [{"role": "system", "content": "s"}, {"role": "user", "content": "u"},
                 {"role": "assistant", "content": "a"}, {"role": "user", "content": _PROBE}]
        for generation_prompt in (True, False):
            kwargs: dict[str, Any] = {"tokenize": False, "add_generation_prompt": generation_prompt}
            if chosen:
                kwargs["chat_template"] = chosen
            try:
                same = render(probe, None, generation_prompt) == tokenizer.apply_chat_template(probe, **kwargs)
            except Exception:
                return None
            if not same:
                return None
        return render

    def render_text(self, messages: list[dict[str, Any]], tools: list | None, add_generation_prompt: bool) -> str:
        templated = self._template_messages(messages, tools)
        schemas = tools if tools and self.supports_tools else None
        try:
            return self._apply_template(templated, schemas, add_generation_prompt)
        except Exception as err:  # template errors are the request's fault (e.g. role order)
            folded = fold_late_system_messages(templated)
            if folded is not templated:
                # Claude Code puts a system message in the middle of `messages`; templates that insist
                # on one leading system message get its text appended to that message instead.
                try:
                    return self._apply_template(folded, schemas, add_generation_prompt)
                except Exception:
                    pass
            raise RequestError(f"the chat template rejected these messages: {err}") from None

    def _encode(self, text: str) -> np.ndarray:
        try:
            return self._tokens.encode(text)
        except Exception as err:  # e.g. a lone surrogate (valid JSON, not valid text)
            raise RequestError(f"the request text cannot be tokenized: {type(err).__name__}") from None

    def tokenize(self, text: str, limit: int | None = None) -> np.ndarray:
        """Token ids of ``text``; PromptTooLong when ``limit`` is given and the text has more tokens."""
        if limit is not None and len(text) > 2 * CHUNK_CHARS:
            self._refuse_if_longer(text, limit)
        ids = self._encode(text)
        if limit is not None and len(ids) > limit:
            raise PromptTooLong(len(ids), exact=True)
        return np.asarray(ids, dtype=np.int32)

    def _refuse_if_longer(self, text: str, limit: int) -> None:
        """Count ``text``'s tokens a chunk at a time (cut at whitespace where there is some) and raise
        PromptTooLong as soon as the count, less CHUNK_SLACK_TOKENS per cut, exceeds ``limit``."""
        count, start, cuts = 0, 0, 0
        while start < len(text):
            end = start + CHUNK_CHARS
            if end < len(text):
                half = start + CHUNK_CHARS // 2
                space = max(text.rfind(" ", half, end), text.rfind("\n", half, end))
                end = space if space > start else end
            else:
                end = len(text)
            count += len(self._encode(text[start:end]))
            proven = count - CHUNK_SLACK_TOKENS * cuts
            if proven > limit:
                raise PromptTooLong(proven)
            start, cuts = end, cuts + 1

    def render(self, messages: list[dict[str, Any]], tools: list | None, limit: int | None = None) -> np.ndarray:
        """Full re-render of a prompt (with the generation prompt), at most ``limit`` tokens."""
        return self.tokenize(self.render_text(messages, tools, add_generation_prompt=True), limit)

    def extend(self, prev: TurnRecord, messages: list[dict[str, Any]], tools: list | None,
               limit: int | None = None) -> np.ndarray | None:
        """Cumulative token mode: ``prev`` tokens + the tokens of the messages that follow them.

        The caller has checked that ``messages`` starts with ``prev.messages + [prev.response_message]``.
        Returns None when the text that follows that response cannot be told apart from the template's
        output (then the caller re-renders in full). The whole prompt is at most ``limit`` tokens (else
        PromptTooLong).
        """
        k = len(prev.messages) + 1
        history = self.render_text(messages[:k], tools, add_generation_prompt=False)
        full = self.render_text(messages, tools, add_generation_prompt=True)
        if full.startswith(history) and self._assistant_tail is not None:
            after = self._assistant_tail + full[len(history) :]
        else:  # e.g. Qwen3: the last message gets a <think> block that history drops
            after = self._text_after_response(messages, k, tools, full)
            if after is None:
                return None
        ended = len(prev.response_ids) > 0 and int(prev.response_ids[-1]) in self._end_ids
        if ended:  # the sampled end token already wrote the template's end marker
            end_text = self._end_ids[int(prev.response_ids[-1])]
            if not after.startswith(end_text):
                return None
            after = after[len(end_text) :]
        known = len(prev.prompt_ids) + len(prev.response_ids)
        try:
            delta = self.tokenize(after, None if limit is None else max(0, limit - known))
        except PromptTooLong as err:
            raise PromptTooLong(known + err.at_least, err.exact) from None
        return np.concatenate([prev.prompt_ids, prev.response_ids, delta]).astype(np.int32, copy=False)

    def _text_after_response(self, messages: list[dict[str, Any]], k: int, tools: list | None,
                             full: str) -> str | None:
        """The text the template writes after message ``k - 1`` (the previous response) when that
        message's own rendering depends on what follows it (Qwen3 and other reasoning templates render
        the reasoning of the last message and drop it from history), so history is no prefix of the full
        render. The response is replaced by a probe; what follows the probe is accepted only when the full
        render ends with it, i.e. the new messages render the same with or without the real response."""
        probed = [*messages[: k - 1], {"role": "assistant", "content": _PROBE}, *messages[k:]]
        try:
            text = self.render_text(probed, tools, add_generation_prompt=True)
        except RequestError:
            return None
        at = text.find(_PROBE)
        after = text[at + len(_PROBE) :] if at >= 0 else None
        return after if after is not None and full.endswith(after) else None

    def count_tokens(self, messages: list[dict[str, Any]], tools: list | None, limit: int | None = None) -> int:
        """Prompt length of a request, exactly as it would be sent to the engine (full render); counted
        up to ``limit`` (PromptTooLong beyond)."""
        return len(self.render(messages, tools, limit))

    # -- template probes ---------------------------------------------------------------------------

    def generation_prompt_opens_think(self) -> bool:
        """Whether the template's generation prompt already opens a ``<think>`` block (R1-style)."""
        try:
            text = self.tokenizer.apply_chat_template(
                [{"role": "user", "content": _PROBE}], tokenize=False, add_generation_prompt=True,
                chat_template=self.chat_template,
            )
        except Exception:
            return False
        tail = text[text.rfind(_PROBE) :]  # a probe, not a word: "hi" is also inside "<think>"
        return "<think>" in tail and "</think>" not in tail

    def _probe_assistant_tail(self) -> str | None:
        """The text a template writes after an assistant message's content (end marker + glue)."""
        msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": _PROBE}]
        try:
            text = self.tokenizer.apply_chat_template(
                msgs, tokenize=False, add_generation_prompt=False, chat_template=self.chat_template
            )
        except Exception:
            return None
        if _PROBE not in text:
            return None
        return text[text.index(_PROBE) + len(_PROBE) :]

    def _end_token_ids(self) -> dict[int, str]:
        ids: dict[int, str] = {}
        candidates = [getattr(self.tokenizer, "eos_token", None), "<|im_end|>", "<|eot_id|>", "<|end|>"]
        for tok in candidates:
            if not tok:
                continue
            tid = self.tokenizer.convert_tokens_to_ids(tok)
            if isinstance(tid, int) and tid != getattr(self.tokenizer, "unk_token_id", None):
                ids[tid] = tok
        return ids
