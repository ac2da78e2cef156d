"""Streaming ``/generate`` calls to the engines, for streaming clients.

Non-streaming turns use ``Router.generate`` (one JSON answer). A streaming client wants text as it is
generated, so the gateway asks the engine for SGLang's streaming ``/generate`` (``stream: true``)
through ``Router.generate_stream``: the same router picks the engine (session affinity, load counts),
so streaming and non-streaming turns of one session land on the same engine.

Both kinds of call queue in the router while generation is paused (the colocated schedule gives the
devices to the trainer): the agent's HTTP request simply takes longer, up to the router's
``wait_timeout_s``, then goes on with the new weights; a generation aborted by the pause is continued
from its tokens so far (partial rollout). ``queue_depth`` is how many calls wait now.

Cancellation: when the client goes away the handler is cancelled; the router aborts the engine request
explicitly with ``/abort_request`` (and closes its connection), so an abandoned generation never keeps a
batch slot busy.
"""

from __future__ import annotations

import logging
from typing import Any, Mapping, Sequence

import numpy as np

from rayrl.engines.client import GenerateOutput
from rayrl.engines.router import OnText

logger = logging.getLogger("rayrl.gateway")


class StreamingUpstream:
    """Streaming generation over a Router's engines (``Router.generate_stream``)."""

    def __init__(self, router: Any, timeout_s: float = 600.0) -> None:
        self.router = router
        self.timeout_s = timeout_s

    @property
    def queue_depth(self) -> int:
        """LLM calls waiting at the gateway for generation to resume."""
        return int(getattr(self.router, "waiting", 0))

    async def close(self) -> None:
        """The router owns the connections; it closes them in ``Router.close``."""

    async def generate(
        self,
        session_key: str,
        input_ids: Sequence[int] | np.ndarray,
        sampling_params: Mapping[str, Any],
        on_text: OnText,
    ) -> GenerateOutput:
        """Generate with streaming; ``on_text`` gets the cumulative text, ids and log-probs after every chunk."""
        return await self.router.generate_stream(session_key, input_ids, sampling_params, on_text)
