"""Structural equality of chat messages, the only notion of "same message" the tree routes by.

Why structural and not serialised: ``dict ==`` ignores key order (clients re-serialise messages with
keys in any order), short-circuits on the first differing field and never builds a string, so comparing
a request's history against the tree costs less than parsing that request.

The rule (top level of the message only, documented so every caller agrees):

* key order never matters;
* a key whose value is empty (``None``, ``""``, ``[]``, ``{}``) is the same as an absent key: OpenAI
  clients echo an assistant message with tool calls as ``content: null``, ``content: ""`` or with no
  ``content`` at all, and ``name: null`` or ``tool_calls: []`` mean nothing either;
* keys in :data:`IGNORED_KEYS` never matter: they do not change what the model is conditioned on as a
  *message* (``reasoning_content`` is dropped or kept by templates; if it changes the tokens, the token
  level notices it as TITO drift, which is where that belongs);
* everything else, including nested values (tool-call argument strings), must be equal. A re-rendered
  tool call is a different message; the fork-merge rescue deals with that. Content as a list of text
  parts is not the same as the equivalent plain string: converting requests to one OpenAI shape is the
  gateway's job, before a turn is recorded.
"""

from __future__ import annotations

from typing import Any, Hashable

IGNORED_KEYS: frozenset[str] = frozenset({"reasoning_content", "refusal", "annotations"})


def _is_empty(value: Any) -> bool:
    if value is None:
        return True
    if isinstance(value, (str, list, dict, tuple)):
        return len(value) == 0
    return False


def routing_view(message: dict[str, Any]) -> dict[str, Any]:
    """The part of ``message`` that routing compares: empty and ignored keys removed."""
    return {k: v for k, v in message.items() if k not in IGNORED_KEYS and not _is_empty(v)}


def messages_equal(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """Whether two chat messages are the same message for routing purposes.

    Fast paths first (identity, then plain ``==``, which is the common case for an echoed history);
    only when those fail are the normalised views compared. Equivalent to
    ``routing_view(a) == routing_view(b)``, so it is an equivalence relation.
    """
    if a is b:
        return True
    if a.get("role") != b.get("role"):
        return False
    if a == b:
        return True
    return routing_view(a) == routing_view(b)


def _frozen(value: Any) -> Hashable:
    """A hashable stand-in for ``value`` that is equal for equal values: dicts become frozensets of their
    items, lists and tuples tuples, sets frozensets; anything else unhashable a marker naming its type
    (which only makes a coarser bucket, never a wrong one)."""
    if isinstance(value, str):
        return value
    if isinstance(value, dict):
        return frozenset([(k, _frozen(v)) for k, v in value.items()])
    if isinstance(value, (list, tuple)):
        return tuple([_frozen(v) for v in value])
    if isinstance(value, (set, frozenset)):
        return frozenset([_frozen(v) for v in value])
    try:
        hash(value)
    except TypeError:
        return ("unhashable", type(value).__name__)  # equal after pickling, unlike a sentinel object
    return value


def routing_key(message: dict[str, Any]) -> Hashable:
    """A hash key under which :func:`messages_equal` messages always meet: equal messages have equal keys
    (the converse need not hold; a bucket is still checked with :func:`messages_equal`).

    Why: a node of the tree may collect thousands of children (a session that retries one prompt, or
    that opens a fresh conversation under one system prompt on every call), and looking a message up
    among them must not cost a comparison per child. The key is that of the routing view (role
    included), so key order, empty fields and ignored fields never change it; the common message (text
    values only) takes the inlined path.
    """
    items = []
    for k, v in message.items():
        if v is None or k in IGNORED_KEYS:
            continue
        if isinstance(v, str):
            if v:
                items.append((k, v))
        elif not _is_empty(v):
            items.append((k, _frozen(v)))
    return frozenset(items)
