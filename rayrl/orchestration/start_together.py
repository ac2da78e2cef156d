"""StartTogether: the run's parts (engines, trainer, gateway, sandboxes, workers) start at the same time.

Why: each part spends its start in its own processes (an engine server loading weights and kernels, a
trainer rank loading the model and its optimizer, the gateway loading the tokenizer and probing the chat
template, sandboxes being made), and none of that needs another part, so started one after the other the
run waits for the sum of them, started together for the longest. What does depend on another part is
said where it is: a part's function may wait on another's :meth:`Part.result` (the colocated trainer
waits for the engines to release their memory), and what joins two parts (the engines' addresses for the
gateway, the weight plan) runs after :meth:`StartTogether.wait`.

Each part's function runs on a daemon thread of the driver and returns the part (its handle); the Ray
work is in the part's own actors, so the threads only wait. Plain threads, no Ray: the tests drive it
with plain functions. When a part fails, :meth:`StartTogether.wait` raises its error at once (the first
to fail: the cause; a part that failed because it waited on it follows from it) and every part that
started, or starts later, is stopped with its ``stop`` function, so a failed start leaves no engine or
trainer rank behind in a Ray that lives on (a notebook's).
"""

from __future__ import annotations

import logging
import threading
from typing import Any, Callable, Generic, Optional, TypeVar

from rayrl.startup import READY, StartupClock

T = TypeVar("T")

logger = logging.getLogger(__name__)


class Part(Generic[T]):
    """One part starting: its result once its start function returned, or the error it raised."""

    def __init__(self, name: str, stop: Optional[Callable[[T], Any]]) -> None:
        self.name = name
        self._stop = stop
        self._done = threading.Event()
        self._value: Any = None
        self._error: Optional[BaseException] = None
        self._abandoned = False
        self._lock = threading.Lock()

    @property
    def done(self) -> bool:
        return self._done.is_set()

    @property
    def failed(self) -> bool:
        return self._done.is_set() and self._error is not None

    def result(self, timeout: Optional[float] = None) -> T:
        """The part, once started; raises what its start raised (``PartNotStarted`` when a part it waited
        on failed: the cause is that part's error)."""
        if not self._done.wait(timeout):
            raise TimeoutError(f"{self.name} did not start within {timeout} s")
        if self._error is not None:
            raise self._error
        return self._value

    def _finish(self, value: Any, error: Optional[BaseException]) -> None:
        with self._lock:
            self._value, self._error = value, error
            self._done.set()
            abandoned = self._abandoned
        if abandoned and error is None:
            self._stop_value()

    def _abandon(self) -> None:
        """Stop the part now if it started, else as soon as it does."""
        with self._lock:
            if self._abandoned:
                return
            self._abandoned = True
            started = self._done.is_set() and self._error is None
        if started:
            self._stop_value()

    def _stop_value(self) -> None:
        if self._stop is None:
            return
        try:
            self._stop(self._value)
        except Exception as err:  # stopping after a failed start: the start's error is the one to report
            logger.warning("stopping %s after a failed start: %s", self.name, err)


class PartNotStarted(RuntimeError):
    """A part could not start because a part it waits on failed."""


class StartTogether:
    """Starts named parts at once and waits for all of them; marks each one's ready time on the clock."""

    def __init__(self, clock: Optional[StartupClock] = None) -> None:
        self.clock = clock
        self.parts: dict[str, Part[Any]] = {}
        self._finished = threading.Condition()
        self._order: list[str] = []  # names in the order they finished

    def part(self, name: str, start: Callable[[], T], stop: Optional[Callable[[T], Any]] = None) -> Part[T]:
        """Start ``start()`` on its own thread now; ``stop(result)`` undoes it when the start as a whole
        fails. The clock gets ``<name>`` began now and its ready phase (rayrl/startup.py READY) when it
        returns."""
        if name in self.parts:
            raise ValueError(f"part {name!r} started twice")
        part: Part[T] = Part(name, stop)
        self.parts[name] = part
        began = self.clock.now() if self.clock is not None else 0.0

        def run() -> None:
            value, error = None, None
            try:
                value = start()
            except BaseException as err:  # noqa: BLE001 - handed to the waiting thread, which raises it
                error = err
            if error is None and self.clock is not None:
                self.clock.mark(READY.get(name, f"{name}_ready"), began=round(began, 3))
            part._finish(value, error)
            with self._finished:
                self._order.append(name)
                self._finished.notify_all()

        threading.Thread(target=run, name=f"start-{name}", daemon=True).start()
        return part

    def after(self, *parts: Part[Any]) -> None:
        """Inside a part's start: wait for ``parts``; a failed one stops this part too (PartNotStarted)."""
        for other in parts:
            try:
                other.result()
            except BaseException as err:
                raise PartNotStarted(f"{other.name} did not start ({type(err).__name__})") from err

    def wait(self) -> None:
        """Until every part has started; the first part that fails (not for another's failure) has its
        error raised at once, and every part is stopped (now, or when it has started)."""
        while True:
            with self._finished:
                failed = [self.parts[n] for n in self._order if self.parts[n].failed]
                if not failed and len(self._order) < len(self.parts):
                    self._finished.wait()
                    continue
            break
        if not failed:
            return
        cause = next((p for p in failed if not isinstance(p._error, PartNotStarted)), failed[0])
        for part in self.parts.values():
            part._abandon()
        assert cause._error is not None
        raise cause._error
