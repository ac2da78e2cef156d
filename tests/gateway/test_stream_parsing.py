"""Streaming never sends what the final parse would not: deltas always add up to the recorded message.

Property test: for completions built from text, tool-call blocks, think blocks, marker fragments,
whitespace and multi-byte characters, fed to DeltaTracker in random chunkings (as cumulative text,
with half characters shown as U+FFFD the way a detokenizer does), the concatenated content and
reasoning deltas equal the final parse exactly, for every parser combination.
"""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from rayrl.gateway.parsers import (
    HermesToolParser,
    Llama3JsonToolParser,
    ThinkReasoningParser,
    ToolParser,
    parse_completion,
)
from rayrl.gateway.streaming import DeltaTracker

PIECES = ["Hello", " world", "\n", "  ", "<tool", "_call>", "<tool_call>", "</tool_call>",
          '{"name": "f", "arguments": {"x": 1}}', "<think>", "</think>", "<th", "ink>", "{", "}", "é", "日本",
          "<|python_tag|>", '{"name": "g", "parameters": {}}', "; ", "answer"]
PARSERS = [(HermesToolParser(), None), (HermesToolParser(), ThinkReasoningParser()),
           (HermesToolParser(), ThinkReasoningParser(opened_in_prompt=True)), (Llama3JsonToolParser(), None),
           (ToolParser(), ThinkReasoningParser())]


@settings(max_examples=300, deadline=None)
@given(pieces=st.lists(st.sampled_from(PIECES), max_size=12), cuts=st.lists(st.integers(0, 200), max_size=8),
       which=st.integers(0, len(PARSERS) - 1), half_char=st.booleans())
def test_streamed_deltas_equal_final_parse(pieces, cuts, which, half_char):
    tool_parser, reasoning_parser = PARSERS[which]
    text = "".join(pieces)
    tracker = DeltaTracker(tool_parser, reasoning_parser)
    content, reasoning = [], []
    for cut in sorted(c for c in cuts if c <= len(text)):
        partial = text[:cut] + ("\ufffd" if half_char else "")
        d_reasoning, d_content = tracker.feed(partial)
        reasoning.append(d_reasoning)
        content.append(d_content)
    parsed = parse_completion(text, tool_parser, reasoning_parser)
    d_reasoning, d_content = tracker.finish(parsed, parsed.content)
    assert not tracker.mismatch
    assert "".join(content) + d_content == parsed.content
    assert "".join(reasoning) + d_reasoning == (parsed.reasoning or "")
