"""A GSM8K-style math agent for AgentCore Runtime, trained by rayrl without changing a line.

The agent is ordinary openai-SDK code; ``@rollout_executor`` makes it an AgentCore app that runs it
once per session: the payload is the dataset row's ``metadata`` (here ``{"prompt", "answer"}``),
``rollout`` points the client at rayrl's gateway with this session's token, and whatever the function
returns goes to S3 as the session's result (a crash becomes a failed result).

    python examples/agentcore/math_agent.py      # serves /ping and /invocations on $PORT (8080)

Multi-turn on purpose: when the first reply does not end with ``#### <number>``, the agent asks once
more. The gateway records both calls; the second extends the first token for token (cumulative token
mode), so the gateway merges them into one training sample with the follow-up masked.
"""

from __future__ import annotations

from typing import Any

from rayrl.agents.agentcore import RolloutContext, rollout_executor

SYSTEM = "Solve the math word problem. Think step by step, then end with a line '#### <number>'."
FOLLOW_UP = "Give only the final answer as '#### <number>'."


@rollout_executor
def math_agent(payload: dict[str, Any], rollout: RolloutContext) -> dict[str, Any]:
    client = rollout.openai_client()
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": str(payload["prompt"])}]
    answer, turns = "", 0
    try:
        while turns < max(1, rollout.max_turns):
            reply = client.chat.completions.create(model=rollout.model, messages=messages, **rollout.sampling)
            turns += 1
            answer = reply.choices[0].message.content or ""
            messages.append({"role": "assistant", "content": answer})
            if "####" in answer:
                break
            messages.append({"role": "user", "content": FOLLOW_UP})
    finally:
        client.close()
    return {"final_answer": answer, "turns": turns}


if __name__ == "__main__":
    math_agent.run()
