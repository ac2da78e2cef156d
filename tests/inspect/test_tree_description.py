"""The turn tree's description for inspection (rayrl/trajectory/describe.py), the gateway's admin route
that serves a live session's tree, and the promise that describing never changes the samples."""

from __future__ import annotations

import json
import urllib.request

import numpy as np

from rayrl.trajectory import TrajectoryTree
from rayrl.types import TurnRecord
from tests.inspect.scripted_run import SUB_SYSTEM, SYSTEM, TOOLS, ScriptedGateway, tangle_episode


def _by_role_text(tree: dict, role: str, text: str) -> dict:
    return next(n for n in tree["nodes"] if n["role"] == role and n["text"].startswith(text))


def test_scripted_episode_tree_shows_drift_fork_merge_branch_and_calls(scripted_run):
    _, made = scripted_run
    episode = made["steps"][1][0]
    tree = episode.tree
    assert tree["version"] == 1 and tree["stats"]["turns"] == 4
    nodes = tree["nodes"]
    assert [n["id"] for n in nodes] == list(range(len(nodes)))
    assert all(n["parent"] is None or n["parent"] < n["id"] for n in nodes)  # parents come first
    # the sub-agent is a second top-level branch, made by the fourth LLM call
    sub = _by_role_text(tree, "system", SUB_SYSTEM)
    assert sub["parent"] is None and sub["branch"] == "root" and sub["call"] == 3 and sub["calls"] == 1
    main = _by_role_text(tree, "system", SYSTEM)
    assert "branch" not in main and main["call"] == 0 and main["calls"] == 3
    gens = {n["gen"]["turn"]: n for n in nodes if "gen" in n}
    assert sorted(gens) == [0, 1, 2, 3]
    # call 0 wrote the tool call; the tool result was added by call 1's request
    assert gens[0]["tool_calls"][0]["name"] == "calculator"
    tool = next(n for n in nodes if n["role"] == "tool")
    assert tool["parent"] == gens[0]["id"] and tool["call"] == 1
    assert tool["tool_call_id"] == gens[0]["tool_calls"][0]["id"]
    # call 1's answer was re-rendered by the client: merged (fork-merge rescue), trains nothing
    assert gens[1]["gen"]["merged"] and gens[1]["text"] == "The answer is 5. "
    assert tree["stats"]["merged_rewrites"] == 1
    # call 2's prompt re-renders call 0's compact tool call: TITO drift inside call 0's response
    drift = gens[2]["gen"]["drift"]
    assert drift["kind"] == "response" and drift["prev_turn"] == 0 and drift["turn"] == 2
    first = gens[0]["gen"]
    assert first["prompt_len"] <= drift["position"] < first["prompt_len"] + first["response_len"]
    assert gens[1]["gen"]["drift"] is None  # a merged node's drift splits nothing (as the counters say)
    # every sample names the calls whose responses it holds: the link from tokens to tree nodes
    turns = [s.metadata["turn_indices"] for s in episode.samples]
    assert turns == [[0], [2], [3]]
    assert episode.samples[1].metadata["drift"]["position"] == drift["position"]
    assert episode.samples[1].metadata["merged_turns"] == 1


def _turn(messages, prompt, response, version=1):
    return TurnRecord(messages=messages, response_message={"role": "assistant", "content": f"r{len(prompt)}"},
                      prompt_ids=prompt, response_ids=response, response_logprobs=[-0.5] * len(response),
                      policy_version=version)


def test_describing_a_tree_never_changes_its_samples():
    system, user = {"role": "system", "content": "s"}, {"role": "user", "content": "u"}
    turns = [
        _turn([system, user], [1, 2, 3], [4, 5]),
        _turn([system, user, {"role": "assistant", "content": "r3"}, {"role": "user", "content": "again"}],
              [1, 2, 3, 4, 5, 6, 7], [8, 9]),
        _turn([system, user, {"role": "assistant", "content": "r3"}, {"role": "user", "content": "other"}],
              [1, 2, 3, 4, 9, 6], [7]),  # a fork that drifts inside turn 0's response
        _turn([{"role": "system", "content": "sub"}, user], [1, 7], [3]),
    ]
    plain, described = TrajectoryTree(), TrajectoryTree()
    for turn in turns:
        plain.record_turn(turn)
        described.record_turn(turn)
        described.describe()
    view = described.describe(text_chars=1)
    assert len(view["nodes"]) == plain.stats()["nodes"] and all(len(n["text"]) <= 1 for n in view["nodes"])
    assert [n.get("branch") for n in view["nodes"] if n.get("branch")] == ["fork", "root"]
    a, b = plain.samples(1.0), described.samples(1.0)
    assert len(a) == len(b) == 3
    for x, y in zip(a, b):
        for field in ("tokens", "loss_mask", "rollout_logprobs", "policy_versions"):
            assert np.array_equal(getattr(x, field), getattr(y, field))
        assert x.metadata == y.metadata


def _get(url: str, token: str | None) -> tuple[int, dict]:
    request = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"} if token else {})
    try:
        with urllib.request.urlopen(request, timeout=30) as resp:
            return resp.status, json.load(resp)
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


def test_admin_route_serves_a_live_sessions_tree(tiny_model_dir):
    gw = ScriptedGateway(tiny_model_dir)
    try:
        info = gw.gateway.open_session({"group_id": "g"})
        root = gw.gateway.base_url[: -len("/v1")]
        url = f"{root}/rayrl/sessions/{info.session_id}/tree"
        gw.chat(info.token, [{"role": "system", "content": SYSTEM},
                             {"role": "user", "content": "What is 2 + 3? calculator"}])
        status, live = _get(url, gw.gateway.admin_token)
        assert status == 200 and live["stats"]["turns"] == 1 and live["session"]["session_id"] == info.session_id
        assert [n["role"] for n in live["nodes"]] == ["system", "user", "assistant"]
        assert live["nodes"][2]["gen"]["turn"] == 0 and live["session"]["requests"] == 1
        status, short = _get(url + "?text_chars=3", gw.gateway.admin_token)
        assert status == 200 and short["nodes"][0]["text"] == SYSTEM[:3] and short["nodes"][0]["chars"] == len(SYSTEM)
        # bad input: a clear JSON 4xx naming what was wrong
        assert _get(url, None)[0] == 401 and _get(url, info.token)[0] == 401  # a session token is not the admin's
        status, body = _get(url + "?text_chars=lots", gw.gateway.admin_token)
        assert status == 400 and body["error"]["param"] == "text_chars"
        status, body = _get(url + "?text_chars=-1", gw.gateway.admin_token)
        assert status == 400 and body["error"]["param"] == "text_chars"
        status, body = _get(f"{root}/rayrl/sessions/s0-nope/tree", gw.gateway.admin_token)
        assert status == 404 and "s0-nope" in body["error"]["message"]
        # looking changed nothing: the session goes on and finishes into the same samples as an unwatched one
        episode = tangle_episode(gw, "g2")
        other = gw.gateway.open_session({"group_id": "g"})
        assert _get(f"{root}/rayrl/sessions/{other.session_id}/tree", gw.gateway.admin_token)[0] == 200
        samples, _ = gw.finish(info.session_id, 1.0)
        assert len(samples) == 1 and samples[0].metadata["turn_indices"] == [0]
        assert [s.metadata["turn_indices"] for s in episode.samples] == [[0], [2], [3]]
        assert _get(url, gw.gateway.admin_token)[0] == 404  # finished sessions are gone
    finally:
        gw.close()


def test_tool_schemas_are_not_part_of_the_tree(scripted_run):
    """Tool schemas do not route (messages.py) and are not stored: the description names none of them."""
    _, made = scripted_run
    text = json.dumps(made["steps"][1][0].tree)
    assert TOOLS[0]["function"]["description"] not in text
