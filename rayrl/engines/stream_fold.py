"""One engine stream's chunks, parsed only as far as the answer needs them.

SGLang's ``/generate`` stream is cumulative by default (each chunk holds every token so far) or
incremental; :class:`~rayrl.engines.outputs.StreamAccumulator` folds either. A caller that streams to its
agent needs every chunk parsed as it comes (:meth:`StreamFold.fold`). One that does not needs only the
answer, and in a cumulative stream the last chunk alone is the answer: parsing every chunk of a long
generation costs the square of its length, and the router parsed and folded the first two only to learn
the stream's kind (docs/results/gateway_hot_path.md, seventh pass).

So :meth:`StreamFold.feed` parses nothing while it can wait. Chunks are held raw until the stream ends;
the last one is parsed, and when it shows by its own count that it holds the whole answer (its
``completion_tokens`` is the number of its ``output_ids``, with a log-prob for each and a text) and no
chunk before it may be an error report (the bytes ``"error"`` in none of them), it alone is folded:
folding the others before it would give the same output, since such a chunk replaces everything they
set. Otherwise the held chunks are folded in order, exactly as if each had been folded as it arrived,
so an engine's in-stream error is raised where it was before (SGLang ends its stream after one). What is
held is bounded: once it passes ``hold_bytes`` (a long cumulative stream grows as the square of its
length) the held chunks are folded in order at once, which tells the stream's kind, and from then on a
cumulative stream keeps only its latest chunk, an incremental one folds each chunk as it comes.

Two differences from the fold before this module (each chunk parsed on arrival until the kind was
known): an error report among the first chunks is raised when the stream ends (or breaks, or passes the
bound), not as it arrives; and a chunk that is not JSON, among those the last chunk makes unnecessary, is
never read (as the middle chunks of a cumulative stream were not before). It is also quicker
(docs/results/design_figures.md).
"""

from __future__ import annotations

from typing import Any, Optional

from rayrl.engines import wire_json
from rayrl.engines.client import EngineError
from rayrl.engines.outputs import StreamAccumulator

HOLD_BYTES = 65536  # raw chunks held unparsed while the stream's kind is unknown


class StreamFold:
    """The chunks of one stream from the engine at ``url`` into :attr:`acc`; :attr:`finished` once a
    chunk with a finish reason has been folded."""

    def __init__(self, url: str, hold_bytes: int = HOLD_BYTES) -> None:
        self.url = url
        self.hold_bytes = hold_bytes
        self.acc = StreamAccumulator()
        self.finished = False
        self._pending: list[bytes] = []  # chunks not parsed yet, in order, while the stream's kind is unknown
        self._pending_bytes = 0
        self._held: Optional[bytes] = None  # a cumulative stream's latest chunk, not parsed yet

    def _parse(self, data: bytes) -> Any:
        chunk = wire_json.loads(data)
        if isinstance(chunk, dict) and "error" in chunk:
            err = chunk["error"]
            raise EngineError(500, str(err.get("message") if isinstance(err, dict) else err), self.url)
        return chunk

    def _add(self, chunk: Any) -> None:
        self.acc.add(chunk)
        self.finished = (self.acc.meta.get("finish_reason") or None) is not None

    def fold(self, data: bytes) -> None:
        """Parse and fold one chunk now (an in-stream error is an EngineError)."""
        self._add(self._parse(data))

    def feed(self, events: list[bytes]) -> bool:
        """The ``data:`` payloads of one read, for a caller that does not stream; True at ``[DONE]`` (what
        follows it in the read is not looked at)."""
        done = b"[DONE]" in events
        if done:
            events = events[:events.index(b"[DONE]")]
        if not events:
            return done
        cumulative = self.acc.cumulative
        if cumulative:
            self._held = events[-1]  # only the last one will be read
        elif cumulative is False:
            for data in events:
                self.fold(data)
        else:
            self._pending += events
            self._pending_bytes += sum(map(len, events))
            if self._pending_bytes > self.hold_bytes:
                self._drain()
        return done

    def _drain(self) -> None:
        """Fold the pending chunks in order, as if each had been folded on arrival: once the stream has
        shown itself cumulative, only the last of the rest is kept (unparsed)."""
        pending, self._pending, self._pending_bytes = self._pending, [], 0
        for data in pending:
            if self.acc.cumulative:
                self._held = pending[-1]
                return
            self.fold(data)

    def settle(self) -> None:
        """Fold what is still held: at the stream's end, or where it broke (then :attr:`acc` holds the
        tokens received so far)."""
        pending = self._pending
        if pending and (b'"error"' in b"".join(pending[:-1]) or not self._whole(pending[-1])):
            self._drain()
        self._pending, self._pending_bytes = [], 0
        held, self._held = self._held, None
        if held is not None:
            self.fold(held)

    def _whole(self, last: bytes) -> bool:
        """Fold ``last`` alone if it holds the whole answer by its own count (see the module docstring);
        False, folding nothing, when it does not (or is not JSON: then the in-order fold reports it)."""
        try:
            chunk = wire_json.loads(last)
        except ValueError:
            return False
        if not isinstance(chunk, dict) or "error" in chunk or not chunk.get("text"):
            return False
        ids = chunk.get("output_ids") or []
        meta = chunk.get("meta_info") or {}
        total = meta.get("completion_tokens") if isinstance(meta, dict) else None
        if not isinstance(total, int) or isinstance(total, bool) or total != len(ids):
            return False
        if len(meta.get("output_token_logprobs") or []) != total:
            return False
        self._add(chunk)
        return True
