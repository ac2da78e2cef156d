"""SandboxPoolActor under contention on a real local Ray, with owners dying while they hold leases.

16 owner actors (threaded Ray actors) each start 16 lease cycles at once: 256 lease requests contend for a
small pool of real (default-isolation) sandboxes. One cycle = acquire, open the sandbox from the lease's
handle, check it starts from a fresh working directory, write a marker, run ``true`` in it, hold 10-50 ms,
check the marker is still ours, release. Every step is logged with a timestamp (CLOCK_MONOTONIC, shared by
all processes on the node) to a per-owner append-only file, so the log survives the owner being killed.

A few owners, picked at random, are doomed: after a random number of grants they stop starting new work,
park every lease they hold or still get (each parked lease runs a long ``sleep`` inside its sandbox), and
are killed with ``ray.kill`` while holding those leases. They are killed only once no request of theirs is
in flight (every cycle parked or returned), so the number of leases a dead owner held is known exactly;
their unserved cycles are handed to surviving owners, so exactly 256 leases are granted in all.

Checked afterwards: no lease lost (granted == released + reclaimed, 0 leased), none given twice (no two
lease intervals on one sandbox overlap; a dead owner's lease lasts at least until its kill), the pool's
reclaim count equals the leases the killed owners held, the parked commands died, and after shutdown no
sandbox directory or process is left.
"""

from __future__ import annotations

import itertools
import json
import os
import random
import shutil
import sys
import tempfile
import threading
import time
from collections import defaultdict

import pytest

ray = pytest.importorskip("ray")

from sbtest_helpers import processes_matching  # noqa: E402

from actors.sandbox_pool import SandboxPoolActor  # noqa: E402
from rayrl.config import SandboxConfig, SandboxPoolConfig  # noqa: E402
from rayrl.sandboxes import SandboxError, open_sandbox  # noqa: E402
from rayrl.sandboxes.isolation import MARKER_ENV  # noqa: E402
from rayrl.sandboxes.pool import PoolExhausted  # noqa: E402
from tests.ray_support import wait_until_dead  # noqa: E402

OWNERS = 16
CYCLES_PER_OWNER = 16  # 256 lease requests in flight at the start
DOOMED = 4
MAX_SIZE = 12
HOLD_S = (0.010, 0.050)
RUN_DEADLINE_S = 90.0  # the lease phase must end well within this (it takes a few seconds)


@pytest.fixture(scope="module")
def ray_local():
    # address="local": always a fresh Ray of our own, even where RAY_ADDRESS points at a running job.
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # this test file is not importable there
    yield
    ray.shutdown()


@pytest.fixture
def stress_root():
    """A fresh sandbox root (0711 under /tmp so the sandbox uids can traverse it), an event-log dir, and a
    list the test puts its actors in: they are killed before the directories go, even when the test
    failed half-way (a live pool would otherwise recreate its root after the cleanup)."""
    root = tempfile.mkdtemp(prefix="rayrl-stress-", dir="/tmp")
    os.chmod(root, 0o711)
    logs = tempfile.mkdtemp(prefix="rayrl-stress-log-", dir="/tmp")
    actors: list = []
    yield root, logs, actors
    for actor in actors:
        ray.kill(actor, no_restart=True)
    for actor in actors:  # ray.kill is asynchronous: each must be gone before its directories go
        wait_until_dead(actor)
    shutil.rmtree(root, ignore_errors=True)
    shutil.rmtree(logs, ignore_errors=True)


@ray.remote(num_cpus=0, max_concurrency=2 * CYCLES_PER_OWNER, concurrency_groups={"control": 1})
class LeaseOwner:
    """Stands in for a rollout worker running many episodes at once; the pool owner is its actor id."""

    def __init__(self, pool, index: int, log_dir: str, doom_after: int | None, attempt_s: float) -> None:
        self.pool = pool
        self.index = index
        self.owner = ray.get_runtime_context().get_actor_id()
        self.doom_after = doom_after  # None: never dies; n: start dying at this owner's n-th grant
        self.attempt_s = attempt_s  # per-request acquire timeout (retried): a dying owner stops retrying
        self.fd = os.open(os.path.join(log_dir, f"owner-{index:02d}.jsonl"),
                          os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        self.lock = threading.Lock()
        self.dying = False
        self.grants = 0
        self.state: dict[int, str] = {}  # cycle -> waiting | holding | releasing | parked | done | abandoned
        self.parked: list[tuple[str, str, str]] = []  # (lease_id, sandbox_id, sleep token)

    def _log(self, kind: str, **fields) -> None:
        line = json.dumps({"kind": kind, "owner": self.index, "t": time.monotonic(), **fields}) + "\n"
        os.write(self.fd, line.encode())  # one O_APPEND write: on disk even if we are killed next

    @ray.method(concurrency_group="control")
    def ident(self) -> str:
        return self.owner

    @ray.method(concurrency_group="control")
    def status(self) -> dict:
        with self.lock:
            return {"dying": self.dying, "state": dict(self.state), "parked": list(self.parked)}

    def lease_cycle(self, cycle: int, hold_s: float) -> str:
        with self.lock:
            self.state[cycle] = "waiting"
        while True:
            with self.lock:
                if self.dying:
                    self.state[cycle] = "abandoned"
                    self._log("abandon", cycle=cycle)
                    return "abandoned"
            try:
                lease = ray.get(self.pool.acquire.remote(self.owner, None, self.attempt_s))
                break
            except PoolExhausted:
                continue
        sid = lease.handle.sandbox_id
        self._log("acq", cycle=cycle, lease=lease.lease_id, sid=sid)
        with self.lock:
            self.grants += 1
            self.state[cycle] = "holding"
            if self.doom_after is not None and self.grants >= self.doom_after:
                self.dying = True
        sb = open_sandbox(lease.handle)
        try:
            sb.read_file("holder")
            self._log("err", cycle=cycle, msg=f"{sid}: a new lease found the previous holder's file")
        except FileNotFoundError:
            pass
        sb.write_file("holder", lease.lease_id.encode())
        result = sb.exec(["true"], timeout=30)
        if not result.ok:
            self._log("err", cycle=cycle, msg=f"{sid}: `true` failed: {result}")
        self._park_if_dying(cycle, lease, sb)
        time.sleep(hold_s)
        self._park_if_dying(cycle, lease, sb)
        if sb.read_file("holder") != lease.lease_id.encode():
            self._log("err", cycle=cycle, msg=f"{sid}: someone else wrote into our leased sandbox")
        with self.lock:
            self.state[cycle] = "releasing"
        self._log("rel", cycle=cycle, lease=lease.lease_id, sid=sid)
        if not ray.get(self.pool.release.remote(lease.lease_id)):
            self._log("err", cycle=cycle, msg=f"{sid}: release of a live lease returned False")
        with self.lock:
            self.state[cycle] = "done"
        return "done"

    def _park_if_dying(self, cycle: int, lease, sb) -> None:
        """Hold the lease with a command running in the sandbox until this actor is killed."""
        with self.lock:
            if not self.dying:
                return
            token = f"{86400 + self.index * 1000 + cycle}.5"  # a unique `sleep` argument to find it by
            self.state[cycle] = "parked"
            self.parked.append((lease.lease_id, lease.handle.sandbox_id, token))
        self._log("park", cycle=cycle, lease=lease.lease_id, sid=lease.handle.sandbox_id, token=token)
        try:
            result = sb.exec(["sleep", token], timeout=600)
        except SandboxError as err:
            result = err
        # Only our death ends it. ray.kill kills an actor's child processes before the actor itself
        # (Ray's kill_child_processes_on_worker_exit), so we may live to log this: the test checks it
        # happened after the kill.
        self._log("unparked", cycle=cycle, lease=lease.lease_id, result=repr(result))
        time.sleep(600)


def _marked_processes(prefixes: set[str]) -> list[int]:
    """Host pids whose environment carries a sandbox marker of one of these sandbox ids."""
    needles = [f"\0{MARKER_ENV}={p}:".encode() for p in prefixes]
    found = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/environ", "rb") as f:
                env = b"\0" + f.read()
        except OSError:
            continue
        if any(n in env for n in needles):
            found.append(int(name))
    return found


def _wait_for(predicate, timeout: float, interval: float = 0.05):
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value or time.monotonic() > deadline:
            return value
        time.sleep(interval)


@pytest.mark.slow  # ~50 s; fast: sandboxes/test_sandbox_pool_actor (leases, dead owners, backpressure)
def test_256_contending_leases_with_owner_deaths(ray_local, stress_root):
    root, log_dir, actors = stress_root
    seed = int(os.environ.get("RAYRL_STRESS_SEED", random.SystemRandom().randrange(1 << 30)))
    rng = random.Random(seed)
    ctx = f"(RAYRL_STRESS_SEED={seed})"
    t_start = time.monotonic()

    pool = SandboxPoolActor.remote(
        SandboxConfig(),  # the real default: isolation auto (bwrap here), per-sandbox uid, limits
        SandboxPoolConfig(min_warm=4, max_size=MAX_SIZE, lease_s=120, acquire_timeout_s=60,
                          health_interval_s=5),
        tick_s=0.2, root=root)
    actors.append(pool)
    doomed = set(rng.sample(range(OWNERS), DOOMED))
    owners = {
        i: LeaseOwner.remote(pool, i, log_dir, rng.randint(1, 6) if i in doomed else None,
                             1.0 if i in doomed else 60.0)
        for i in range(OWNERS)
    }
    actors.extend(owners.values())
    ray.get([o.ident.remote() for o in owners.values()], timeout=120)  # all 16 owners are up
    _wait_for(lambda: ray.get(pool.stats.remote())["warm"] >= 4, timeout=30)
    t_ready = time.monotonic()

    pending: dict = {}  # ObjectRef -> (owner index, cycle)
    for i, owner in owners.items():
        for c in range(CYCLES_PER_OWNER):
            pending[owner.lease_cycle.remote(c, rng.uniform(*HOLD_S))] = (i, c)
    alive = set(owners)
    killed_at: dict[int, float] = {}
    parked: dict[int, list[tuple[str, str, str]]] = {}
    results: dict[tuple[int, int], str] = {}
    next_cycle = CYCLES_PER_OWNER
    deadline = time.monotonic() + RUN_DEADLINE_S
    while pending:
        assert time.monotonic() < deadline, f"lease phase did not finish in {RUN_DEADLINE_S}s {ctx}"
        ready, _ = ray.wait(list(pending), num_returns=len(pending), timeout=0.05)
        for ref in ready:
            i, c = pending.pop(ref)
            if i in killed_at:
                with pytest.raises(ray.exceptions.RayActorError):
                    ray.get(ref)  # a parked cycle dies with its owner
                continue
            results[(i, c)] = ray.get(ref)
            if results[(i, c)] == "abandoned":  # the owner died before this request was served
                survivor = rng.choice(sorted(alive - doomed))
                pending[owners[survivor].lease_cycle.remote(next_cycle, rng.uniform(*HOLD_S))] = \
                    (survivor, next_cycle)
                next_cycle += 1
        for i in sorted(doomed & alive):
            status = ray.get(owners[i].status.remote())
            # Kill only once every cycle of this owner is parked or has returned to us (abandoned ones are
            # already handed on): then exactly the parked leases are held at death, no request in flight.
            if not status["dying"] or any(status["state"].get(c) != "parked"
                                           for j, c in pending.values() if j == i):
                continue
            tokens = [tok for _, _, tok in status["parked"]]
            assert tokens, f"a dying owner holds nothing {ctx}"
            assert _wait_for(lambda tokens=tokens: all(processes_matching(f"sleep\0{t}") for t in tokens),
                             timeout=20), f"parked commands never started {ctx}"
            time.sleep(rng.uniform(0, 0.02))
            killed_at[i] = time.monotonic()
            ray.kill(owners[i], no_restart=True)
            alive.discard(i)
            parked[i] = status["parked"]
    t_leases_done = time.monotonic()

    # Every killed owner's lease comes back (upkeep sees the actor DEAD) and its parked command dies.
    held_by_dead = sum(len(p) for p in parked.values())
    assert set(killed_at) == doomed, ctx

    def settled() -> dict | None:
        s = ray.get(pool.stats.remote())
        return s if s["leased"] == 0 and s["busy"] == 0 else None

    stats = _wait_for(settled, timeout=30)
    assert stats, f"leases never came back: {ray.get(pool.stats.remote())} {ctx}"
    t_reclaimed = time.monotonic()
    all_tokens = [tok for p in parked.values() for _, _, tok in p]
    assert _wait_for(lambda: not any(processes_matching(f"sleep\0{t}") for t in all_tokens), timeout=10), \
        f"a dead owner's command outlived the reclaim {ctx}"

    # ---- the event log
    events = []
    for name in sorted(os.listdir(log_dir)):
        with open(os.path.join(log_dir, name)) as f:
            events += [json.loads(line) for line in f]
    errors = [e for e in events if e["kind"] == "err"]
    assert not errors, f"{errors[:5]} {ctx}"
    early = [e for e in events if e["kind"] == "unparked" and e["t"] < killed_at[e["owner"]]]
    assert not early, f"a parked lease's command died before its owner was killed: {early[:3]} {ctx}"
    acquired = {e["lease"]: e for e in events if e["kind"] == "acq"}
    released = {e["lease"]: e for e in events if e["kind"] == "rel"}
    parked_ids = {lease for p in parked.values() for lease, _, _ in p}
    assert len(acquired) == OWNERS * CYCLES_PER_OWNER == 256, f"{len(acquired)} leases granted {ctx}"
    assert parked_ids <= set(acquired) and not parked_ids & set(released), ctx
    assert set(released) | parked_ids == set(acquired), f"a lease neither released nor held at death {ctx}"
    assert list(results.values()).count("done") == len(released), ctx

    # No two leases on one sandbox at once. A lease lasts from its acquire to its release; a killed owner's
    # lease at least until the kill (the pool may reclaim it only after that).
    intervals = defaultdict(list)
    for lease, e in acquired.items():
        end = released[lease]["t"] if lease in released else killed_at[e["owner"]]
        intervals[e["sid"]].append((e["t"], end, lease))
    for sid, spans in intervals.items():
        spans.sort()
        for (a0, a1, la), (b0, _, lb) in itertools.pairwise(spans):
            assert a1 <= b0, f"{sid} leased twice at once: {la} [{a0:.4f},{a1:.4f}], {lb} from {b0:.4f} {ctx}"
    points = sorted([(s, 1) for v in intervals.values() for s, _, _ in v] +
                    [(e, -1) for v in intervals.values() for _, e, _ in v], key=lambda p: (p[0], p[1]))
    in_use = peak = 0
    for _, delta in points:
        in_use += delta
        peak = max(peak, in_use)
    assert peak <= MAX_SIZE, ctx

    # ---- the pool's own account agrees
    assert stats["leases_granted"] == 256 and stats["released"] == len(released), (stats, ctx)
    assert stats["reclaimed"] == stats["owner_reclaimed"] == held_by_dead > 0, (stats, ctx)
    assert stats["leases_granted"] == stats["released"] + stats["reclaimed"], (stats, ctx)
    assert stats["expired"] == 0 and stats["stale_releases"] == 0 and stats["failures"] == 0, (stats, ctx)
    assert stats["live"] == stats["warm"] == stats["created"] - stats["destroyed"] <= MAX_SIZE, (stats, ctx)
    assert stats["acquire_latency"]["count"] == 256, (stats, ctx)
    sandbox_ids = set(intervals)

    # ---- nothing leaks: after shutdown no sandbox directory and no sandbox process remains
    final = ray.get(pool.shutdown.remote(), timeout=60)
    assert final["live"] == 0 and final["closed"], final
    assert [n for n in os.listdir(root) if n.startswith("sb-")] == [], ctx
    assert _marked_processes(sandbox_ids) == [], f"sandbox processes outlived the pool {ctx}"
    assert processes_matching(root) == [], f"processes still reference {root} {ctx}"
    timing = (f"ready {t_ready - t_start:.1f}s (actors + warm pool), leases {t_leases_done - t_ready:.1f}s, "
              f"reclaim {t_reclaimed - t_leases_done:.1f}s; {held_by_dead} leases reclaimed from {DOOMED} "
              f"killed owners, {len(sandbox_ids)} sandboxes used, peak {peak} leased at once, "
              f"{stats['exhausted']} timed-out retries, acquire p50/max "
              f"{sorted(stats['acquire_latency']['recent_s'])[128] * 1e3:.0f}/"
              f"{stats['acquire_latency']['max_s'] * 1e3:.0f} ms {ctx}")
    print(timing)
