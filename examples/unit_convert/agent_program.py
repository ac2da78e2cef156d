"""The unit-conversion agent as a standalone program: what ``rollout.agent: command`` runs.

    rollout.agent: command
    rollout.agent_command: [python, examples/unit_convert/agent_program.py]

It knows nothing about rayrl: the openai SDK finds the endpoint in ``OPENAI_BASE_URL`` and
``OPENAI_API_KEY`` by itself, the model name is in ``OPENAI_MODEL``; the task arrives on stdin as one
JSON object (``{"id", "prompt", "metadata"}``); the answer goes to stdout, anything else to stderr.
Try it against any OpenAI-compatible server:

    echo '{"prompt": "Convert 3 feet to cm."}' | OPENAI_BASE_URL=... OPENAI_API_KEY=... OPENAI_MODEL=... \\
        python examples/unit_convert/agent_program.py
"""

from __future__ import annotations

import asyncio
import json
import os
import sys

from agent import run_agent  # agent.py next to this file (Python puts the script's folder on sys.path)
from openai import AsyncOpenAI


async def main() -> None:
    task = json.load(sys.stdin)
    async with AsyncOpenAI() as client:  # OPENAI_BASE_URL and OPENAI_API_KEY from the environment
        answer = await run_agent(client, os.environ["OPENAI_MODEL"], task["prompt"],
                                 max_turns=int(os.environ.get("RAYRL_MAX_TURNS", "4")),
                                 max_tokens=int(os.environ.get("RAYRL_MAX_TOKENS", "96")),
                                 temperature=float(os.environ.get("RAYRL_TEMPERATURE", "1.0")))
    print(answer)


if __name__ == "__main__":
    asyncio.run(main())
