"""Silent-failure guards: per-step figures that say a run is training on a broken signal, on by default.

The commonest way an agentic RL run fails is silently: tool calls that never parse while the reward
still looks fine, a chat template that drops earlier reasoning (the turns stop extending each other
token for token), truncation that turns every long episode into a 0, infrastructure or judge failures
scored as the agent's, groups whose equal rewards train nothing, a step whose every episode failed the
same way (which then trains nothing at all). Each guard is one :class:`Guard`
record in :data:`GUARDS`: the figure it measures (logged every step as ``guards/<metric>``: step line,
metrics.jsonl, TensorBoard/W&B, the Ray dashboard), which way is bad, how many observations a verdict
needs, and how to measure it from the step's episodes. Its action and threshold are config
(``guards.<name>: warn | stop | off`` and ``guards.<name>_max`` / ``_min``, rayrl/config/guards.py, where
the defaults live).

The figures come from what the gateway recorded of each episode's session (``Episode.info["gateway"]``,
rayrl/agents/episode.py ``gateway_facts``: turns, tool calls, tool calls that did not parse, turns cut at
max_tokens, drift events, the last turn's finish), from the failure kinds the runner gave
(rayrl/rl/failures.py) and from the rewards; never from what an agent says it did, except ``tool_errors``
(whether a tool's result was an error is known only to the agent that ran it). An episode without gateway
facts (a harness that records none) is left out of the gateway figures.

A guard fires once its figure has been past its threshold for its ``patience`` steps in a row (3 for the
tool-format guards; 5 for tool errors and zero-variance groups: a model learning its tool format or its
tools' use, or a run converging, is not broken; 1 for the rest), measured by :class:`GuardMonitor`,
which the pipeline keeps for the run. A crossing is one :class:`Crossing`: one printed line naming the
guard, the figure, the threshold and an example episode (its session id and the episodes file it is in,
which the inspector links to), and one JSON line in ``runs/<exp_id>/guards.jsonl``. A guard whose action
is ``stop`` makes the pipeline save a checkpoint and stop with exit code 4, printing the resume command
(actors/pipeline.py, driver.py).
Adding a guard is one record here and its two fields in :class:`GuardsConfig`.
"""

from __future__ import annotations

import json
from collections import defaultdict
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

from rayrl.config.algorithm import AlgorithmConfig
from rayrl.config.guards import GuardsConfig
from rayrl.rl.advantages import REWARD_TOLERANCE
from rayrl.rl.failure_log import dominant_cause
from rayrl.rl.failures import JUDGE_FAILED, REWARD_FAILED, is_infra, is_scored
from rayrl.types import Episode


@dataclass(frozen=True)
class StepView:
    """What a guard sees: every episode the step took (failed ones too), the rollout's turn limit, and
    whether a per-token advantage term (on-policy distillation: rayrl/rl/distill.py) trains every sample
    whatever its group's rewards (not when dynamic sampling drops equal-reward groups: those train nothing)."""

    episodes: Sequence[Episode]
    max_turns: int = 0  # rollout.max_turns (0: unknown)
    per_token_term: bool = False


def teacher_trains_equal_groups(algorithm: AlgorithmConfig, has_teacher: bool) -> bool:
    """Whether a run's equal-reward groups still train (``StepView.per_token_term``): a distillation teacher
    adds a per-token term to every sample, unless its coefficient is 0 or dynamic sampling drops those
    groups before they train."""
    return has_teacher and algorithm.distill_coef != 0 and not algorithm.dynamic_sampling


@dataclass(frozen=True)
class Figure:
    """A guard's measurement: ``value`` (a share) over ``count`` observations, an example episode (the
    first that counts against the guard), any further figures worth logging (already named) and, where a
    number does not say it, a ``detail`` in words."""

    value: float
    count: int
    example: Optional[Episode] = None
    extra: dict[str, float] = field(default_factory=dict)
    detail: str = ""  # what the figure is about, in words, for the crossing's line (the failure's cause)


@dataclass(frozen=True)
class Guard:
    """One guard (module docstring). ``above``: it fires when the figure is above the threshold
    (``guards.<name>_max``), else below it (``_min``); ``min_count``: fewer observations give no verdict;
    ``patience``: the steps in a row the figure must be past the threshold before the guard fires (a model
    that starts out writing malformed tool calls and learns the format in two steps is learning, not
    broken; a run whose groups all solve their tasks for a step is converging)."""

    name: str
    metric: str  # logged as guards/<metric>
    above: bool
    min_count: int
    what: str  # completes "guard <name>: 0.62 of 24 <what>"
    measure: Callable[[StepView], Figure]
    patience: int = 1

    @property
    def threshold_field(self) -> str:
        return f"{self.name}_{'max' if self.above else 'min'}"

    def action(self, cfg: GuardsConfig) -> str:
        return getattr(cfg, self.name)

    def threshold(self, cfg: GuardsConfig) -> float:
        return getattr(cfg, self.threshold_field)

    def crossed(self, figure: Figure, threshold: float) -> bool:
        if figure.count < self.min_count:
            return False
        return figure.value > threshold if self.above else figure.value < threshold


# -- what the gateway recorded ----------------------------------------------------------------------------

def _facts(episode: Episode) -> Optional[dict[str, Any]]:
    facts = episode.info.get("gateway") if isinstance(episode.info, dict) else None
    return facts if isinstance(facts, dict) and facts.get("turns", 0) > 0 else None


def _count(facts: dict[str, Any], key: str) -> int:
    value = facts.get(key, 0)
    return int(value) if isinstance(value, (int, float)) else 0


def _share(hits: list[Episode], weights: int, count: int, **extra: float) -> Figure:
    return Figure(weights / count if count else 0.0, count, hits[0] if hits else None, dict(extra))


# -- the measurements ---------------------------------------------------------------------------------------

def tool_parse_errors(view: StepView) -> Figure:
    """Share of attempted tool calls (parsed calls + turns whose call did not parse) that did not parse."""
    bad, errors, attempts = [], 0, 0
    for e in view.episodes:
        if (f := _facts(e)) is None:
            continue
        n = _count(f, "tool_parse_errors")
        errors += n
        attempts += n + _count(f, "tool_calls")
        if n:
            bad.append(e)
    return _share(bad, errors, attempts)


def _tool_episodes(view: StepView) -> list[tuple[Episode, dict[str, Any]]]:
    """Scored episodes whose task declared tools (some turn's request carried them)."""
    return [(e, f) for e in view.episodes if is_scored(e) and (f := _facts(e)) is not None
            and _count(f, "tool_turns") > 0]


def tool_call_rate(view: StepView) -> Figure:
    """Share of tool-declaring scored episodes that called at least one tool."""
    episodes = _tool_episodes(view)
    none = [e for e, f in episodes if _count(f, "tool_calls") == 0]
    return _share(none, len(episodes) - len(none), len(episodes))


def tool_errors(view: StepView) -> Figure:
    """Share of the recorded tool calls whose result was an error (the agent's count: only it saw the result)."""
    bad, errors, calls = [], 0, 0
    for e in view.episodes:
        if (f := _facts(e)) is None or not _count(f, "tool_calls"):
            continue
        n = min(int(e.info.get("tool_errors", 0) or 0), _count(f, "tool_calls"))
        errors += n
        calls += _count(f, "tool_calls")
        if n:
            bad.append(e)
    return _share(bad, errors, calls)


def unused_tools(view: StepView) -> Figure:
    """Share of the rewarded (> 0) tool-declaring episodes that called no tool: the reward came without them."""
    rewarded = [(e, f) for e, f in _tool_episodes(view) if e.reward > 0]
    none = [e for e, f in rewarded if _count(f, "tool_calls") == 0]
    return _share(none, len(none), len(rewarded))


def _cut(episode: Episode, facts: dict[str, Any], max_turns: int) -> bool:
    """Cut at max_tokens (a turn ended at the limit), or at max_turns (the gateway refused a turn, or the
    session used every turn and its last one still called a tool: the agent was not done). A session that
    used every turn on tool calls that all failed is not cut but stuck: more turns would not help it, and
    ``tool_errors`` measures it (the files example's untrained model, 8 such episodes of 16 in one step)."""
    if _count(facts, "length_turns") or _count(facts, "turn_cap_refusals"):
        return True
    if not (max_turns > 0 and _count(facts, "turns") >= max_turns and facts.get("last_finish") == "tool_calls"):
        return False
    calls = _count(facts, "tool_calls")
    return not (calls > 0 and int(episode.info.get("tool_errors", 0) or 0) >= calls)


def truncation(view: StepView) -> Figure:
    """Share of scored episodes cut by max_tokens / max_turns; ``truncated_reward_share`` is the share of
    the step's reward those episodes got (near 0 while they are many: truncation is scoring them 0)."""
    scored = [(e, f) for e in view.episodes if is_scored(e) and (f := _facts(e)) is not None]
    cut = [e for e, f in scored if _cut(e, f, view.max_turns)]
    total = sum(max(e.reward, 0.0) for e, _ in scored)
    cut_reward = sum(max(e.reward, 0.0) for e in cut)
    return _share(cut, len(cut), len(scored), truncated_reward_share=cut_reward / total if total > 0 else 0.0)


def drift(view: StepView) -> Figure:
    """Share of episodes with a recorded turn whose turns did not extend each other token for token."""
    recorded = [(e, f) for e in view.episodes if (f := _facts(e)) is not None]
    drifted = [e for e, f in recorded if _count(f, "drift")]
    return _share(drifted, len(drifted), len(recorded))


def infra_failures(view: StepView) -> Figure:
    """Share of the step's episodes that infrastructure failed (never trained, never the agent's fault)."""
    bad = [e for e in view.episodes if is_infra(e)]
    return _share(bad, len(bad), len(view.episodes))


def reward_failures(view: StepView) -> Figure:
    """Share of the step's episodes whose reward function raised (scored 0.0) or whose judge gave no verdict
    (``judge_failed``, an infrastructure failure: left out)."""
    bad = [e for e in view.episodes if not e.ok and e.failure in (REWARD_FAILED, JUDGE_FAILED)]
    return _share(bad, len(bad), len(view.episodes))


def one_cause_failures(view: StepView) -> Figure:
    """Share of the step's episodes that failed with its most common cause (the same kind and error once ids
    and numbers are left aside: rayrl/rl/failure_log.py). 1.0 is a step where every episode failed the same
    way (an SDK argument the installed version refuses, a missing key): the run would train on nothing,
    so this guard stops it by default; ``detail`` is the cause."""
    cause = dominant_cause(view.episodes)
    return Figure(cause.share, cause.count, cause.example, detail=cause.cause)


def zero_variance_groups(view: StepView) -> Figure:
    """Share of the step's groups (scored episodes by group) whose rewards are all equal within the
    tolerance the estimators use (such a group's advantages are exactly 0: it trains nothing);
    ``group_reward_std_mean`` is the mean over groups of their rewards' standard deviation. With a
    per-token term (a distillation teacher) no group trains nothing: the share is 0."""
    by_group: dict[str, list[Episode]] = defaultdict(list)
    for e in view.episodes:
        if is_scored(e):
            by_group[e.group_id].append(e)
    equal, stds = [], []
    for members in by_group.values():
        rewards = [e.reward for e in members]
        mean = sum(rewards) / len(rewards)
        stds.append((sum((r - mean) ** 2 for r in rewards) / len(rewards)) ** 0.5)
        if max(rewards) - min(rewards) <= REWARD_TOLERANCE and not view.per_token_term:
            equal.append(members[0])
    std_mean = sum(stds) / len(stds) if stds else 0.0
    return _share(equal, len(equal), len(by_group), group_reward_std_mean=std_mean)


GUARDS: tuple[Guard, ...] = (
    Guard("tool_parse_errors", "tool_parse_error_rate", True, 4, "attempted tool calls did not parse",
          tool_parse_errors, patience=3),
    Guard("tool_call_rate", "tool_call_rate", False, 8, "tool-declaring episodes called a tool", tool_call_rate,
          patience=3),
    Guard("tool_errors", "tool_error_rate", True, 8, "tool calls returned an error", tool_errors, patience=5),
    Guard("unused_tools", "unused_tools_rate", True, 4, "rewarded tool-declaring episodes called no tool",
          unused_tools, patience=3),
    Guard("truncation", "truncated_rate", True, 4, "scored episodes were cut by max_tokens / max_turns",
          truncation),
    Guard("drift", "drift_rate", True, 4, "episodes drifted (turns not extending each other token for token)",
          drift),
    Guard("infra_failures", "infra_failure_rate", True, 4, "episodes failed by infrastructure", infra_failures),
    Guard("reward_failures", "reward_failure_rate", True, 4, "episodes' reward functions or judges failed",
          reward_failures),
    Guard("zero_variance_groups", "zero_variance_group_rate", True, 2, "groups had all-equal rewards (train nothing)",
          zero_variance_groups, patience=5),
    Guard("one_cause_failures", "one_cause_failure_rate", True, 4, "episodes failed for one cause",
          one_cause_failures),
)
GUARDS_BY_NAME = {g.name: g for g in GUARDS}


# -- one step's verdicts ---------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Crossing:
    """One guard past its threshold in one step."""

    guard: str
    action: str  # warn | stop
    value: float
    count: int
    threshold: float
    above: bool
    what: str
    step: int
    session_id: Optional[str]  # the example episode
    task_id: Optional[str]
    episodes_file: Optional[str]  # the step's episodes file (runs/<exp_id>/episodes/stepNNNNNN.jsonl)
    index: Optional[int] = None  # the example's position among the step's episodes: its line in that file
    steps: int = 1  # steps in a row the figure has been past the threshold
    detail: str = ""  # the figure's detail in words (Figure.detail), e.g. the cause of the failures

    def line(self) -> str:
        """The one line a crossing prints."""
        side = "above" if self.above else "below"
        where = "no single episode to show"
        if self.index is not None:
            file = f"{self.episodes_file}, " if self.episodes_file else ""
            name = self.session_id or f"#{self.index}"
            where = f"e.g. episode {name} (task {self.task_id}, {file}line {self.index + 1})"
        then = "stopping the run" if self.action == "stop" else f"set guards.{self.guard}: stop to stop on it"
        streak = f" for {self.steps} steps in a row" if self.steps > 1 else ""
        detail = f" ({self.detail})" if self.detail else ""
        return (f"[rayrl] guard {self.guard} at step {self.step}: {self.value:.2f} of {self.count} {self.what}"
                f"{detail}, {side} its threshold {self.threshold:g}{streak}; {where}; {then}")


@dataclass
class GuardReport:
    """A step's guard figures (``guards/*`` metrics) and crossings."""

    metrics: dict[str, float]
    crossings: list[Crossing]

    @property
    def stop(self) -> Optional[Crossing]:
        """The first crossing whose guard stops the run, if any."""
        return next((c for c in self.crossings if c.action == "stop"), None)

    def summary(self) -> str:
        """The step line's part: the guards that fired, shortest form ("" when none did)."""
        return f"guards: {', '.join(c.guard for c in self.crossings)}" if self.crossings else ""


class GuardMonitor:
    """The guards of one run: measures every guard each step and keeps how many steps in a row each has
    been past its threshold (``patience``; counted from the run's start or resume)."""

    def __init__(self, cfg: GuardsConfig, guards: Sequence[Guard] = GUARDS) -> None:
        self.cfg = cfg
        self.guards = tuple(guards)
        self.streaks: dict[str, int] = {g.name: 0 for g in self.guards}

    def check(self, view: StepView, step: int, episodes_file: Optional[str] = None) -> GuardReport:
        """The step's figures, log-ready for every guard (an ``off`` guard's too), and the crossings of those
        that are on and have been past their threshold for ``patience`` steps in a row."""
        metrics: dict[str, float] = {}
        crossings: list[Crossing] = []
        for guard in self.guards:
            figure = guard.measure(view)
            metrics[f"guards/{guard.metric}"] = figure.value
            metrics.update({f"guards/{k}": v for k, v in figure.extra.items()})
            action, threshold = guard.action(self.cfg), guard.threshold(self.cfg)
            past = action != "off" and guard.crossed(figure, threshold)
            self.streaks[guard.name] = self.streaks[guard.name] + 1 if past else 0
            if not past or self.streaks[guard.name] < guard.patience:
                continue
            ex = figure.example
            index = next((i for i, e in enumerate(view.episodes) if e is ex), None)
            crossings.append(Crossing(guard.name, action, figure.value, figure.count, threshold, guard.above,
                                      guard.what, step, ex.session_id if ex else None, ex.task_id if ex else None,
                                      episodes_file, index, self.streaks[guard.name], figure.detail))
        metrics["guards/fired"] = float(len(crossings))
        return GuardReport(metrics, crossings)


def check_guards(view: StepView, cfg: GuardsConfig, step: int, episodes_file: Optional[str] = None,
                 guards: Sequence[Guard] = GUARDS) -> GuardReport:
    """One step on its own, as if every guard had already been past its threshold for its patience: what
    this step alone says (tests, a notebook looking at one step)."""
    monitor = GuardMonitor(cfg, guards)
    monitor.streaks = {g.name: g.patience - 1 for g in monitor.guards}
    return monitor.check(view, step, episodes_file)


class GuardStop(Exception):
    """A guard whose action is ``stop`` fired: the pipeline checkpoints and the driver exits with code 4."""

    def __init__(self, crossing: Crossing) -> None:
        super().__init__(crossing.line())
        self.crossing = crossing


GUARDS_FILE = "guards.jsonl"


def write_crossings(run_dir: Path, crossings: Sequence[Crossing]) -> None:
    """Append the crossings to ``runs/<exp_id>/guards.jsonl`` (the inspector reads them)."""
    if not crossings:
        return
    with (run_dir / GUARDS_FILE).open("a") as fh:
        for c in crossings:
            fh.write(json.dumps(asdict(c)) + "\n")


def read_crossings(run_dir: Path) -> list[dict[str, Any]]:
    """Every crossing the run recorded, oldest first (a half-written last line is skipped)."""
    path = run_dir / GUARDS_FILE
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return out
