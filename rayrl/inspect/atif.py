"""Export recorded episodes as ATIF trajectories (the Agent Trajectory Interchange Format that Harbor and
others read; RFC 0001 of github.com/laude-institute/harbor, written here as ATIF-v1.8).

How a turn tree becomes ATIF, which is linear: the root-to-leaf path with the most LLM calls (the newest
call breaks a tie) is the trajectory; every other leaf's path (a sub-agent, a compacted context, a retry or a
fork) is an embedded ``subagent_trajectories`` entry, complete from its first message, whose steps that
the main path also holds are marked ``is_copied_context`` (ATIF's flag for context that is not new
training data). System and user messages are ``system`` / ``user`` steps; an assistant message is an
``agent`` step with its tool calls (arguments parsed as JSON where they are JSON); a tool message's
content is an observation result of the agent step whose tool call it answers (``source_call_id``), or
a ``system`` step's observation when no such step precedes it. A generated message carries its token
counts and, for episodes whose token detail was kept, ``prompt_token_ids``, ``completion_token_ids``
and ``logprobs`` from the sample that trains it; rayrl's own facts (LLM call, policy version, drift,
fork-merge, reward, advantage) go under ``extra.rayrl``.

What it cannot restore: message texts are as the run records kept them (cut short for episodes
without token detail; ``extra.rayrl.chars`` gives the full length), and no timestamps are recorded.
"""

from __future__ import annotations

import json
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

from rayrl.inspect.reader import RunReader

ATIF_VERSION = "ATIF-v1.8"


def _rayrl_version() -> str:
    try:
        return version("rayrl")
    except PackageNotFoundError:
        return "unknown"


def _arguments(raw: str) -> dict[str, Any]:
    try:
        value = json.loads(raw) if raw else {}
    except json.JSONDecodeError:
        return {"_raw": raw}
    return value if isinstance(value, dict) else {"_value": value}


def _paths(nodes: list[dict[str, Any]]) -> tuple[list[int], list[list[int]]]:
    """(the main path, the other leaves' paths) as lists of node ids from the root (module docstring)."""
    has_child = {n["parent"] for n in nodes if n["parent"] is not None}
    paths = []
    for n in nodes:
        if n["id"] in has_child:
            continue
        path, current = [], n["id"]
        while current is not None:
            path.append(current)
            current = nodes[current]["parent"]
        paths.append(path[::-1])

    def rank(path: list[int]) -> tuple[int, int]:
        turns = [nodes[i]["gen"]["turn"] for i in path if nodes[i].get("gen")]
        return len(turns), max(turns, default=-1)

    main = max(paths, key=rank)
    return main, [p for p in paths if p is not main]


def _token_metrics(gen: dict[str, Any], samples: list[dict[str, Any]] | None) -> dict[str, Any]:
    """Token ids and log-probs of one generated turn, from the sample that trains it (mask 1 there)."""
    metrics: dict[str, Any] = {"prompt_tokens": gen["prompt_len"], "completion_tokens": gen["response_len"]}
    start, end = gen["prompt_len"], gen["prompt_len"] + gen["response_len"]
    for s in samples or []:
        if gen["turn"] not in s.get("turns", []) or len(s["tokens"]) < end:
            continue
        mask = [v for v, n in s["mask"] for _ in range(n)]
        offset = start - s["prompt_length"]
        if offset < 0 or not mask[offset]:
            continue
        metrics["prompt_token_ids"] = s["tokens"][:start]
        metrics["completion_token_ids"] = s["tokens"][start:end]
        metrics["logprobs"] = s["logprobs"][offset:offset + gen["response_len"]]
        break
    return metrics


def _steps(nodes: list[dict[str, Any]], path: list[int], samples: list[dict[str, Any]] | None,
           copied: set[int]) -> list[dict[str, Any]]:
    steps: list[dict[str, Any]] = []
    last_agent: dict[str, Any] | None = None
    for node_id in path:
        n = nodes[node_id]
        role, text = n["role"], n.get("text", "")
        facts: dict[str, Any] = {"node": node_id, "role": role, "chars": n.get("chars", len(text))}
        if role == "tool" and last_agent is not None:
            ids = {c["tool_call_id"] for c in last_agent.get("tool_calls", [])}
            call_id = n.get("tool_call_id")
            result = {"source_call_id": call_id if call_id in ids else None, "content": text}
            last_agent.setdefault("observation", {"results": []})["results"].append(result)
            continue
        step: dict[str, Any] = {"source": {"system": "system", "developer": "system", "user": "user",
                                           "assistant": "agent"}.get(role, "system"), "message": text}
        if role == "tool":
            step["message"] = ""
            step["observation"] = {"results": [{"content": text}]}
        if role == "assistant":
            calls = [{"tool_call_id": c.get("id") or f"call-{node_id}-{k}", "function_name": c.get("name", ""),
                      "arguments": _arguments(c.get("arguments", ""))} for k, c in enumerate(n.get("tool_calls", []))]
            if calls:
                step["tool_calls"] = calls
            gen = n.get("gen")
            if gen:
                step["metrics"] = _token_metrics(gen, samples)
                step["llm_call_count"] = 1
                facts.update({"llm_call": gen["turn"], "policy_version": gen.get("version"),
                              "finish_reason": gen.get("finish_reason"), "fork_merge": bool(gen.get("merged")),
                              "drift": gen.get("drift"), "retry": bool(gen.get("retry"))})
            last_agent = step
        else:
            last_agent = None
        if node_id in copied:
            step["is_copied_context"] = True
        step["extra"] = {"rayrl": facts}
        steps.append(step)
    for i, step in enumerate(steps, 1):
        step["step_id"] = i
    return steps


def episode_trajectory(detail: dict[str, Any], model_name: str) -> dict[str, Any] | None:
    """One episode (a reader's ``episode()`` answer) as an ATIF trajectory; None without a recorded tree."""
    row, tree, samples = detail["row"], detail.get("tree"), detail.get("samples")
    nodes = (tree or {}).get("nodes") or []
    if not nodes:
        return None
    main, others = _paths(nodes)
    on_main = set(main)
    agent = {"name": row.get("harness") or "rayrl", "version": _rayrl_version(), "model_name": model_name}
    steps = _steps(nodes, main, samples, set())
    gens = [nodes[i]["gen"] for i in main if nodes[i].get("gen")]
    out: dict[str, Any] = {
        "schema_version": ATIF_VERSION,
        "session_id": row.get("session_id") or row["key"],
        "trajectory_id": row["key"],
        "agent": agent,
        "steps": steps,
        "final_metrics": {"total_prompt_tokens": sum(g["prompt_len"] for g in gens),
                          "total_completion_tokens": sum(g["response_len"] for g in gens),
                          "total_steps": len(steps)},
        "extra": {"rayrl": {k: row.get(k) for k in ("step", "index", "task_id", "group_id", "reward", "advantage",
                                                    "status", "error", "timings")}},
    }
    subs = []
    for k, path in enumerate(others):
        sub_steps = _steps(nodes, path, samples, on_main)
        subs.append({"schema_version": ATIF_VERSION, "session_id": out["session_id"],
                     "trajectory_id": f"{row['key']}/branch-{k}", "agent": agent, "steps": sub_steps,
                     "final_metrics": {"total_steps": len(sub_steps)}})
    if subs:
        out["subagent_trajectories"] = subs
    return out


def export_atif(reader: RunReader, path: str | Path, session_id: str | None = None) -> dict[str, int]:
    """Write the run's episodes as ATIF to ``path``: one trajectory object when ``session_id`` names an
    episode, else a JSON array of trajectories (one per episode with a recorded tree). Raises KeyError
    when ``session_id`` matches no episode with a recorded tree."""
    run = reader.read()
    model = str((run.config.get("model") or {}).get("path", "")) if isinstance(run.config.get("model"), dict) else ""
    trajectories, skipped = [], 0
    for row in run.episodes:
        if session_id is not None and row.get("session_id") != session_id:
            continue
        detail = reader.episode(row["step"], row["index"])
        trajectory = episode_trajectory(detail, model) if detail is not None else None
        if trajectory is None:
            skipped += 1
            continue
        trajectories.append(trajectory)
    if session_id is not None:
        if not trajectories:
            raise KeyError(f"no episode with session id {session_id!r} and a recorded turn tree in {reader.path}")
        Path(path).write_text(json.dumps(trajectories[0], indent=1))
    else:
        Path(path).write_text(json.dumps(trajectories))
    return {"trajectories": len(trajectories), "skipped": skipped}
