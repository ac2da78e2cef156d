"""An agent program written with the Anthropic SDK (>= 2), as a user outside the project writes one.

``python tests/anthropic_agent.py``: the sampling settings go in ``extra_body`` (messages.create in anthropic
2.x has no ``temperature`` or ``top_p`` argument; the gateway reads them from the body).
``python tests/anthropic_agent.py --as-keyword``: passes ``temperature=`` as a keyword, as code written for
anthropic 0.x does; anthropic 2.x raises TypeError before any request, in every episode (issue 43).
"""

from __future__ import annotations

import json
import os
import sys

import anthropic

task = json.load(sys.stdin)
client = anthropic.Anthropic(max_retries=0)  # ANTHROPIC_BASE_URL and ANTHROPIC_API_KEY from the environment
sampling = {"temperature": float(os.environ["RAYRL_TEMPERATURE"]), "top_p": float(os.environ["RAYRL_TOP_P"])}
messages = [{"role": "user", "content": task["prompt"]}]
print(f"task {task['id']}: asking {os.environ['ANTHROPIC_MODEL']}", file=sys.stderr)
if "--as-keyword" in sys.argv:
    reply = client.messages.create(model=os.environ["ANTHROPIC_MODEL"], max_tokens=16, messages=messages, **sampling)
else:
    reply = client.messages.create(model=os.environ["ANTHROPIC_MODEL"], max_tokens=16, messages=messages,
                                   extra_body=sampling)
print("".join(block.text for block in reply.content if block.type == "text"))
