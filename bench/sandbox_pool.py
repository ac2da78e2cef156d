"""Sandbox latencies, each measured side by side with ``subprocess.run(["true"])`` in one run.

(a) Cold start of a local sandbox: create it and run its first command (``true``), until the result is
    back; also with ``allowed_hosts`` (filtering proxy + in-sandbox forwarder, which every exec starts).
    The first sandbox of a process also probes which isolation works (once per process; the pool
    actor pays it once at startup), so it is reported apart from the steady-state cold start.
(b) ``exec("true")`` round trip in a warm sandbox (the string goes through ``/bin/sh -c``).
(c) Warm acquire: a lease on an idle sandbox, from an in-process ``SandboxPool`` and through the
    ``SandboxPoolActor`` (Ray call from this driver). No-op calls to a sync and to an asyncio Ray actor
    (the pool actor is asyncio) are measured too: the floor of any call through Ray. Releases (which
    reset the sandbox) are timed separately and not counted in (c).

Targets: warm acquire p99 < 5 ms, cold local sandbox < 100 ms. Sandboxes live under a fresh temporary
root (never the node-wide default), and Ray is a fresh local instance (never a running job's cluster).
The targets are absolute; the baseline is context, taken in blocks between the measurements (before
(a), (b) and (c)) so that load elsewhere shows in it too. The record (bench/measure.py) carries the
load average at start and end.

    python bench/sandbox_pool.py [--isolation auto] [--iters 200] [--quick]
"""

from __future__ import annotations

import argparse
import math
import os
import shutil
import statistics
import subprocess
import tempfile
import time
from collections.abc import Callable

from measure import Record, add_common_args

from rayrl.config import SandboxConfig, SandboxPoolConfig
from rayrl.sandboxes.local import LocalSandbox
from rayrl.sandboxes.pool import SandboxPool


def pct(values: list[float], q: float) -> float:
    """Nearest-rank percentile (q in 0..100)."""
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q / 100 * len(ordered)) - 1)]


def timed(fn: Callable[[], object], n: int) -> list[float]:
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


class Report:
    """Rows of latency samples, each shown against the baseline (``subprocess.run(["true"])``)."""

    def __init__(self) -> None:
        self.baseline: list[float] = []
        self.rows: list[tuple[str, list[float], str]] = []

    def add(self, name: str, samples: list[float], target: str = "") -> None:
        self.rows.append((name, samples, target))

    def table(self, record: Record) -> None:
        base = statistics.median(self.baseline)
        rows = []
        for name, s, target in [("subprocess.run(['true'])  [baseline]", self.baseline, "")] + self.rows:
            p50, p99 = statistics.median(s), pct(s, 99)
            rows.append([name, len(s), f"{p50 * 1e3:.2f}", f"{p99 * 1e3:.2f}", f"{max(s) * 1e3:.2f}",
                         f"{p50 / base:.1f}", f"{p99 / base:.1f}", target])
        record.table("latencies; baseline taken in blocks before (a), (b) and (c)",
                     ["measurement", "n", "p50 ms", "p99 ms", "max ms", "p50/base", "p99/base", "target"], rows)


def verdict(ok: bool) -> str:
    return "MET" if ok else "MISSED"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--isolation", default="auto", help="sandbox.isolation (auto|bwrap|unshare|none)")
    ap.add_argument("--iters", type=int, default=200, help="samples per warm measurement")
    ap.add_argument("--cold", type=int, default=30, help="cold sandboxes to create")
    ap.add_argument("--no-ray", action="store_true", help="skip the measurements through the Ray actor")
    add_common_args(ap)
    args = ap.parse_args()
    if args.quick:
        args.iters, args.cold = 20, 3

    record = Record("sandbox_pool", "Sandbox latencies", quick=args.quick, record_dir=args.record_dir)
    root = tempfile.mkdtemp(prefix="rayrl-bench-sb-", dir="/tmp")
    os.chmod(root, 0o711)  # sandbox uids must traverse it (as in the default root)
    config = SandboxConfig(isolation=args.isolation)
    try:
        subprocess.run(["true"], check=True)  # warm the page cache for the baseline
        report = Report()

        def baseline_block() -> None:
            report.baseline += timed(lambda: subprocess.run(["true"], check=True), max(1, args.iters // 3))

        baseline_block()

        # (a) cold start
        def cold() -> LocalSandbox:
            sb = LocalSandbox(config, root=root)
            assert sb.exec(["true"]).ok
            return sb

        t0 = time.perf_counter()
        first = cold()
        first_s = time.perf_counter() - t0
        isolation = first.isolation
        first.close()
        creates, firsts, colds = [], [], []
        for _ in range(args.cold):
            t0 = time.perf_counter()
            sb = LocalSandbox(config, root=root)
            t1 = time.perf_counter()
            assert sb.exec(["true"]).ok
            t2 = time.perf_counter()
            creates.append(t1 - t0)
            firsts.append(t2 - t1)
            colds.append(t2 - t0)
            sb.close()
        report.add("cold sandbox: first in process (+probe)", [first_s])
        report.add("cold sandbox: create + first exec", colds, "< 100 ms")
        report.add("  of which create (dirs, files)", creates)
        report.add("  of which first exec('true')", firsts)
        proxied = SandboxConfig(isolation=args.isolation, network=True, allowed_hosts=["127.0.0.1:9"])
        proxy_colds, proxy_execs = [], []
        for _ in range(args.cold):  # allowed_hosts: + the host proxy, + the in-sandbox forwarder per exec
            t0 = time.perf_counter()
            sb = LocalSandbox(proxied, root=root)
            assert sb.exec(["true"]).ok
            proxy_colds.append(time.perf_counter() - t0)
            proxy_execs.append(timed(lambda sb=sb: sb.exec(["true"]), 1)[0])
            sb.close()
        report.add("cold sandbox with allowed_hosts (proxy)", proxy_colds, "< 100 ms")
        report.add("  exec('true') with allowed_hosts (proxy)", proxy_execs)

        # (b) exec round trip in a warm sandbox
        baseline_block()
        with LocalSandbox(config, root=root) as sb:
            sb.exec("true")
            execs = timed(lambda: sb.exec("true"), args.iters)
        report.add(f"exec('true') warm, isolation={isolation}", execs)

        # (c) warm acquire, in process
        baseline_block()
        pool = SandboxPool(config, SandboxPoolConfig(min_warm=2, max_size=4, recycle_after=1_000_000),
                           factory=lambda: LocalSandbox(config, root=root))
        pool.fill_warm()
        acquires, releases = [], []
        for _ in range(args.iters):
            t0 = time.perf_counter()
            lease = pool.acquire("bench")
            t1 = time.perf_counter()
            pool.release(lease.lease_id)
            releases.append(time.perf_counter() - t1)
            acquires.append(t1 - t0)
        pool.shutdown()
        report.add("warm acquire, in-process SandboxPool", acquires, "p99 < 5 ms")
        report.add("  release (reset for the next lease)", releases)

        ray_rows = None if args.no_ray else bench_ray(config, root, args.iters)
        if ray_rows:
            for name, samples, target in ray_rows:
                report.add(name, samples, target)

        record.note(f"isolation {args.isolation} -> {isolation}; other work on this machine inflates every "
                    "number, the baseline too")
        report.table(record)
        cold_p50 = statistics.median(colds)
        targets = [f"cold local sandbox p50 {cold_p50 * 1e3:.1f} ms < 100 ms: {verdict(cold_p50 < 0.1)} "
                   f"(p99 {pct(colds, 99) * 1e3:.1f} ms: {verdict(pct(colds, 99) < 0.1)})",
                   f"warm acquire p99 in process {pct(acquires, 99) * 1e3:.2f} ms < 5 ms: "
                   f"{verdict(pct(acquires, 99) < 0.005)}"]
        if ray_rows:
            ray_acq = ray_rows[0][1]
            targets.append(f"warm acquire p99 through the Ray actor {pct(ray_acq, 99) * 1e3:.2f} ms < 5 ms: "
                           f"{verdict(pct(ray_acq, 99) < 0.005)}")
        record.note("targets: " + "; ".join(targets))
    finally:
        shutil.rmtree(root, ignore_errors=True)
    record.save()


def bench_ray(config: SandboxConfig, root: str, iters: int) -> list[tuple[str, list[float], str]]:
    import ray

    from actors.sandbox_pool import SandboxPoolActor

    @ray.remote(num_cpus=0)
    class Noop:
        def ping(self) -> None:
            return None

    @ray.remote(num_cpus=0)
    class AsyncNoop:  # the pool actor is an asyncio actor: this is the floor of any call to it
        async def ping(self) -> None:
            return None

    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        pool = SandboxPoolActor.remote(config, SandboxPoolConfig(min_warm=2, max_size=4,
                                                                 recycle_after=1_000_000), root=root)
        noop, async_noop = Noop.remote(), AsyncNoop.remote()
        ray.get([noop.ping.remote(), async_noop.ping.remote()])
        deadline = time.monotonic() + 60
        while ray.get(pool.stats.remote())["warm"] < 2 and time.monotonic() < deadline:
            time.sleep(0.1)
        for _ in range(10):  # warm the call paths
            ray.get(noop.ping.remote())
            ray.get(async_noop.ping.remote())
            ray.get(pool.release.remote(ray.get(pool.acquire.remote("bench")).lease_id))
        pings = timed(lambda: ray.get(noop.ping.remote()), iters)
        async_pings = timed(lambda: ray.get(async_noop.ping.remote()), iters)
        acquires, releases = [], []
        for _ in range(iters):
            t0 = time.perf_counter()
            lease = ray.get(pool.acquire.remote("bench"))
            t1 = time.perf_counter()
            ray.get(pool.release.remote(lease.lease_id))
            releases.append(time.perf_counter() - t1)
            acquires.append(t1 - t0)
        final = ray.get(pool.shutdown.remote())
        assert final["live"] == 0 and final["leases_granted"] == iters + 10, final
        return [("warm acquire, through SandboxPoolActor", acquires, "p99 < 5 ms"),
                ("  no-op call, sync Ray actor [Ray floor]", pings, ""),
                ("  no-op call, asyncio Ray actor [floor]", async_pings, ""),
                ("  release through SandboxPoolActor", releases, "")]
    finally:
        ray.shutdown()


if __name__ == "__main__":
    main()
