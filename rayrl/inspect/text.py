"""The inspector in a terminal: ``python -m rayrl.inspect RUN_DIR --text`` (no browser needed).

Three views over the same data the page reads (rayrl/inspect/reader.py, the JSON API of docs/inspector.md):

* the run (``--text``): the problems met reading it, one line per step from ``metrics.jsonl``, then the
  episodes of one step (``--step N``; default the last), one line each with its ``STEP:INDEX`` key;
* one episode (``--text --episode STEP:INDEX``): its summary, its turns as the gateway recorded
  them (the tree, indented by depth: each message's role and text, the tool calls it made and the tool
  results it got, each LLM call with its policy version, token counts and finish reason, branches, forks,
  fork-merges and drift points), then each training sample as a token view;
* the token view: the prompt (its tail, ``--prompt-chars``), then the response cut into runs of tokens
  that share their mask, policy version and LLM call, each run on its own line behind a tag:
  ``[train v3 #1]`` for tokens that train (mask 1, sampled by version 3 in LLM call #1) and ``[mask]`` for
  tokens in the response that do not (tool output, bridge tokens between turns, a rewritten turn). With
  colour (``--color``, default when the output is a terminal) trained text is green and masked text dim.

Texts are the tokens' own, as the run recorded them (``vocab``); control characters are escaped so a
token that holds a newline or an escape sequence cannot rearrange the terminal.
"""

from __future__ import annotations

from typing import Any

from rayrl.inspect.reader import RunReader

GREEN, DIM, RED, RESET = "\x1b[32m", "\x1b[2m", "\x1b[31m", "\x1b[0m"
STEP_COLUMNS = [  # (metric, heading, format)
    ("rollout/reward_mean", "reward", "{:.3f}"),
    ("rollout/success_rate", "success", "{:.2f}"),
    ("rollout/episodes", "episodes", "{:d}"),
    ("rollout/episodes_failed", "failed", "{:d}"),
    ("rollout/episodes_excluded", "excluded", "{:d}"),
    ("train/trained_samples", "samples", "{:d}"),
    ("rollout/tool_calls_mean", "tools/ep", "{:.2f}"),
    ("time/step_s", "step s", "{:.1f}"),
]


def _visible(text: str) -> str:
    """``text`` with line breaks and other control characters written as escapes (one terminal line)."""
    out = []
    for ch in text:
        if ch == "\n":
            out.append("\\n")
        elif ch == "\t":
            out.append("\\t")
        elif ord(ch) < 32 or ord(ch) == 127 or 0x80 <= ord(ch) < 0xA0:
            out.append(f"\\x{ord(ch):02x}")
        else:
            out.append(ch)
    return "".join(out)


def _short(text: Any, chars: int) -> str:
    text = _visible(str(text or ""))
    return text if len(text) <= chars else text[: max(chars - 1, 0)] + "…"


def _fmt(value: Any, fmt: str) -> str:
    if value is None:
        return "-"
    try:
        return fmt.format(int(value) if "{:d}" in fmt else value)
    except (TypeError, ValueError):
        return str(value)


def _table(headings: list[str], rows: list[list[str]]) -> list[str]:
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(headings)]
    line = lambda cells: "  ".join(c.ljust(w) for c, w in zip(cells, widths)).rstrip()  # noqa: E731
    return [line(headings), *(line(r) for r in rows)]


def run_view(reader: RunReader, step: int | None = None, width: int = 100) -> str:
    """The run: header, problems, one line per step, the episodes of ``step`` (default: the last one)."""
    run = reader.read()
    summary = run.summary()
    steps = summary["steps"]
    out = [f"run {summary['exp_id']}  ({summary['path']})",
           f"model {summary['model'] or '?'}  harness {summary['harness'] or '?'}  steps with episodes: "
           f"{len(steps)}  episodes: {len(run.episodes)}"]
    out += [f"problem: {p}" for p in run.problems]
    metrics = sorted((m for m in run.metrics if any(k.startswith(("rollout/", "train/")) for k in m)),
                     key=lambda m: m["step"])
    if metrics:
        out += ["", "steps (metrics.jsonl):"]
        out += _table(["step"] + [h for _, h, _ in STEP_COLUMNS],
                      [[str(m["step"])] + [_fmt(m.get(k), f) for k, _, f in STEP_COLUMNS] for m in metrics])
    if not steps:
        out += ["", "no episodes recorded yet"]
        return "\n".join(out)
    shown = steps[-1] if step is None else step
    if shown not in steps:
        raise KeyError(f"no episodes for step {shown}; steps with episodes: {_ranges(steps)}")
    rows = [e for e in run.episodes if e["step"] == shown]
    out += ["", f"episodes of step {shown} (one in full: --episode STEP:INDEX; another step: --step N):"]
    task_chars = max(width - 70, 20)
    out += _table(["key", "status", "reward", "adv", "turns", "tools", "tokens", "detail", "task"],
                  [[e["key"], _status(e), _fmt(e.get("reward"), "{:g}"), _fmt(e.get("advantage"), "{:.3f}"),
                    _fmt(e.get("turns"), "{:d}"), _fmt(e.get("tool_calls"), "{:d}"), _fmt(e.get("tokens"), "{:d}"),
                    "yes" if e.get("detail") else "", _short(f"{e.get('task_id', '')}: {e.get('prompt', '')}",
                                                              task_chars)] for e in rows])
    return "\n".join(out)


def _status(row: dict[str, Any]) -> str:
    if row.get("discarded"):
        return f"set aside ({row['discarded']})"
    if row.get("status") == "failed":
        return f"failed: {row.get('failure') or '?'}"
    return str(row.get("status", "?"))


def _ranges(values: list[int]) -> str:
    return ", ".join(map(str, values)) if len(values) <= 12 else f"{values[0]} to {values[-1]}"


def episode_view(reader: RunReader, step: int, index: int, color: bool = False, prompt_chars: int = 400,
                 text_chars: int = 300) -> str:
    """One episode of a run: summary, turns and tool calls, then each sample's token view (module docstring)."""
    detail = reader.episode(step, index)
    if detail is None:
        raise KeyError(f"no episode {index} in step {step}")
    return "\n".join(episode_lines(detail["row"], detail.get("tree"), detail.get("samples"), detail.get("vocab") or {},
                                   detail.get("problem"), color, prompt_chars, text_chars)).rstrip() + "\n"


def episode_lines(row: dict[str, Any], tree: dict[str, Any] | None, samples: list[dict[str, Any]] | None,
                  vocab: dict[str, str], problem: str | None = None, color: bool = False, prompt_chars: int = 400,
                  text_chars: int = 300) -> list[str]:
    """An episode from its record (rayrl/records.py: the row, the tree, the samples' detail and their vocab):
    what ``--episode`` prints, and what ``driver.py --dry-run`` prints of its one episode."""
    key = f"episode {row['key']}  " if "key" in row else ""
    out = [f"{key}session {row.get('session_id', '')}  task {row.get('task_id', '')}  group {row.get('group_id', '')}",
           f"status {_status(row)}  agent status {row.get('agent_status', '?')}  reward "
           f"{_fmt(row.get('reward'), '{:g}')}  advantage {_fmt(row.get('advantage'), '{:.4f}')}  turns "
           f"{_fmt(row.get('turns'), '{:d}')}  tool calls {_fmt(row.get('tool_calls'), '{:d}')}  tool errors "
           f"{_fmt(row.get('tool_errors'), '{:d}')}",
           f"prompt: {_short(row.get('prompt'), text_chars)}",
           f"final answer: {_short(row.get('final_answer'), text_chars)}"]
    if row.get("error"):
        out += ["error: " + "\n  ".join(map(_visible, str(row["error"]).splitlines()))]  # a traceback keeps its lines
    stderr = str(row.get("stderr") or "").strip()
    if stderr and stderr[-200:] not in str(row.get("error") or ""):  # a failed program's error is its stderr's end
        out += ["stderr (its end):", *("  " + _visible(line) for line in stderr.splitlines())]
    timings = row.get("timings") or {}
    if timings:
        out.append("timings: " + "  ".join(f"{k} {v:.2f}" for k, v in timings.items() if isinstance(v, (int, float))))
    if problem:
        out.append(f"problem: {problem}")
    out += ["", "turns:"] + (_tree_lines(tree, text_chars) if tree else ["  no tree recorded"])
    out += [""]
    if samples is None:
        out.append("token view: not kept for this episode (only the first logging.inspect_episodes_per_step "
                   "episodes of a step keep it)")
    for k, sample in enumerate(samples or []):
        out += sample_lines(k, sample, vocab, tree, color, prompt_chars) + [""]
    return out


def _tree_lines(tree: dict[str, Any], text_chars: int) -> list[str]:
    nodes = tree.get("nodes", [])
    depth: dict[int, int] = {}
    stats = tree.get("stats") or {}
    lines = [f"  {stats.get('turns', '?')} LLM calls, {stats.get('tool_calls', '?')} tool calls, "
             f"{stats.get('root_branches', 0)} top-level branch(es), {stats.get('forks', 0)} fork(s), "
             f"{stats.get('merged_rewrites', 0)} fork-merge(s)"]
    for node in nodes:
        parent = node.get("parent")
        depth[node["id"]] = 0 if parent is None else depth.get(parent, 0) + 1
        pad = "  " * (depth[node["id"]] + 1)
        tags = []
        if node.get("branch"):
            tags.append("new top-level branch" if node["branch"] == "root" else "fork")
        gen = node.get("gen")
        if gen:
            tags.append(f"LLM call #{gen['turn']}: v{_version(gen.get('version'))}, prompt {gen['prompt_len']} + "
                        f"response {gen['response_len']} tokens, {gen.get('finish_reason', '?')}")
            if gen.get("merged"):
                tags.append("fork-merge (trains nothing)")
            if gen.get("retry"):
                tags.append("retry")
            if gen.get("drift"):
                d = gen["drift"]
                tags.append(f"drift: {d.get('kind')} @ {d.get('position')} (vs call #{d.get('prev_turn')})")
        elif node.get("call") is not None:
            tags.append(f"from LLM call #{node['call']}")
        if node.get("tool_call_id"):
            tags.append(f"result of {node['tool_call_id']}")
        cut = f" (of {node['chars']} chars)" if node.get("chars", 0) > len(node.get("text", "")) else ""
        lines.append(f"{pad}{node['role']}: {_short(node.get('text'), text_chars)}{cut}"
                     + (f"   [{'; '.join(tags)}]" if tags else ""))
        for call in node.get("tool_calls") or []:
            lines.append(f"{pad}  -> tool call {call.get('name', '?')}({_short(call.get('arguments'), text_chars)})"
                         f"  id {call.get('id', '')}")
    return lines


def _version(version: Any) -> str:
    return f"{version[0]}-{version[1]}" if isinstance(version, list) else str(version)


def _expand(runs: list[list[int]]) -> list[int]:
    return [value for value, count in runs for _ in range(count)]


def sample_lines(k: int, sample: dict[str, Any], vocab: dict[str, str], tree: dict[str, Any] | None,
                 color: bool = False, prompt_chars: int = 400) -> list[str]:
    """One sample's token view: a header, the prompt's tail, the response in tagged runs."""
    tokens, prompt_len = sample["tokens"], sample["prompt_length"]
    mask, versions = _expand(sample["mask"]), _expand(sample["versions"])
    call_at: dict[int, int] = {}
    gens = {n["gen"]["turn"]: n["gen"] for n in (tree or {}).get("nodes", []) if n.get("gen")}
    for turn in sample.get("turns", []):
        g = gens.get(turn)
        if g is not None:
            for i in range(g["prompt_len"], min(g["prompt_len"] + g["response_len"], len(tokens))):
                call_at[i] = turn
    trained = sum(mask)
    text = lambda ids: "".join(vocab.get(str(t), f"<{t}>") for t in ids)  # noqa: E731
    lines = [f"sample {k}: LLM calls {' '.join(f'#{t}' for t in sample.get('turns', []))}  {len(tokens)} tokens "
             f"(prompt {prompt_len}, trained {trained}, masked {len(mask) - trained})  reward "
             f"{_fmt(sample.get('reward'), '{:g}')}  advantage {_fmt(sample.get('advantage'), '{:.4f}')}  "
             f"{sample.get('status', '')}"]
    if sample.get("drift"):
        d = sample["drift"]
        lines.append(f"  starts at a TITO drift ({d.get('kind')}): call #{d.get('turn')}'s prompt differs from call "
                     f"#{d.get('prev_turn')}'s tokens at token {d.get('position')}")
    if sample.get("merged_turns"):
        lines.append(f"  {sample['merged_turns']} fork-merged turn(s) before its calls train nothing")
    prompt = _visible(text(tokens[:prompt_len]))
    if len(prompt) > prompt_chars:
        prompt = f"…({len(prompt) - prompt_chars} chars before) " + prompt[-prompt_chars:]
    lines.append(f"  [prompt] {_paint(prompt, DIM, color)}")
    runs: list[tuple[tuple[int, int, int | None], list[int]]] = []  # (mask, version, call), token ids
    for i in range(prompt_len, len(tokens)):
        key = (mask[i - prompt_len], versions[i - prompt_len], call_at.get(i))
        if runs and runs[-1][0] == key:
            runs[-1][1].append(tokens[i])
        else:
            runs.append((key, [tokens[i]]))
    for (trains, version, call), ids in runs:
        tag = f"[train v{version}{'' if call is None else f' #{call}'}]" if trains else "[mask]"
        lines.append(f"  {tag} {_paint(_visible(text(ids)), GREEN if trains else DIM, color)}")
    return lines


def _paint(text: str, code: str, color: bool) -> str:
    return f"{code}{text}{RESET}" if color and text else text
