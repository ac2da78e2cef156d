"""A GSM8K-style math agent for AgentCore Runtime, trained by rayrl without changing a line.

The agent is ordinary openai-SDK code; ``@rollout_executor`` makes it an AgentCore app that runs it
once per session: the payload is the dataset row's ``metadata`` (here ``{"prompt", "answer"}``),
``rollout`` points the client at rayrl's gateway with this session's token, and whatever the function
returns goes to S3 as the session's result (a crash becomes a failed result).

    python examples/agentcore/math_agent.py      # serves /ping and /invocations on $PORT (8080)

Three worked examples go before the problem as earlier chat turns: a small model copies a method and a
format it is shown far more often than one it is told (SmolLM2-135M-Instruct: README.md has the
counts). Multi-turn on purpose:
when the first reply does not end with ``#### <number>``, the agent asks once more. The gateway records
both calls; the second extends the first token for token (cumulative token mode), so the gateway merges
them into one training sample with the follow-up masked.
"""

from __future__ import annotations

from typing import Any

from rayrl.agents.agentcore import RolloutContext, rollout_executor

SYSTEM = "Solve the math word problem. Think step by step, then end with a line '#### <number>'."
EXAMPLES = [  # (problem, worked answer), sent as earlier user/assistant turns
    ("Mia has 4 apples. Mia gets 3 more apples. How many apples does Mia have now?",
     "Mia starts with 4 apples and gets 3 more: 4 + 3 = 7.\n#### 7"),
    ("Leo has 6 boxes with 5 pens in each. How many pens does Leo have?",
     "6 boxes with 5 pens each: 6 * 5 = 30.\n#### 30"),
    ("Sam has 8 cards and gives away 3 of them. How many cards does Sam have left?",
     "Sam has 8 cards and gives away 3: 8 - 3 = 5.\n#### 5"),
]
FOLLOW_UP = "Give only the final answer as '#### <number>'."


@rollout_executor
def math_agent(payload: dict[str, Any], rollout: RolloutContext) -> dict[str, Any]:
    client = rollout.openai_client()
    messages = [{"role": "system", "content": SYSTEM}]
    for question, worked in EXAMPLES:
        messages += [{"role": "user", "content": question}, {"role": "assistant", "content": worked}]
    messages.append({"role": "user", "content": str(payload["prompt"])})
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
