"""One background thread that runs the jobs a caller hands over, one at a time: the publishers' skeleton.

The caller hands a job over with `submit` and waits for the thread with `flush`; a job the thread has not
taken yet may be replaced (a publisher coalesces states) or waited for. Whatever the thread raises, in a
job or in its idle work, stops it and is raised by every later `submit` and `flush`; after `close`, `submit`
raises too. No call waits for a thread that is gone.
"""

from __future__ import annotations

import functools
import logging
import threading
from collections.abc import Callable
from typing import Generic, TypeVar

from deltasync.errors import Stopped

log = logging.getLogger(__name__)
J = TypeVar("J")


class Worker(Generic[J]):
    """Runs `run(job)` for each job handed over, on a thread named `name`, after `start()` if given; while
    idle, `idle()` every `idle_s` seconds (None: never). `what` names the worker in its errors."""

    def __init__(
        self,
        name: str,
        what: str,
        run: Callable[[J], None],
        idle: Callable[[], None] | None = None,
        idle_s: float | None = None,
        start: Callable[[], None] | None = None,
    ):
        self.what, self._run, self._idle, self._idle_s, self._start = what, run, idle, idle_s, start
        self.lock = threading.Condition()  # also guards what the caller and the jobs share
        self._pending: J | None = None
        self._busy = start is not None  # flush() waits for start() too
        self._closed = False
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    def submit(self, make: Callable[[J | None], J], wait: bool = False) -> None:
        """Set the pending job to `make(pending)` (the job not taken yet, or None), under the lock: the thread
        takes it whole. `wait`: first wait until the thread has taken the pending job. Raises the thread's
        error, or Stopped after `close`."""
        with self.lock:
            if wait:
                self.lock.wait_for(lambda: self.error is not None or self._pending is None)
            self.raise_if_failed()
            if self._closed:
                raise Stopped(f"{self.what} is closed")
            self._pending = make(self._pending)
            self.lock.notify_all()

    def take_newer(self, seconds: float) -> J | None:
        """From inside a job: wait up to `seconds` for a newer job, and take it (None if none came)."""
        with self.lock:
            self.lock.wait_for(lambda: self._pending is not None, seconds)
            job, self._pending = self._pending, None
            return job

    def flush(self, timeout: float | None = None) -> None:
        """Wait until every job handed over has run; raises the thread's error (TimeoutError: `timeout`)."""
        with self.lock:
            done = self.lock.wait_for(
                lambda: self.error is not None or not (self._pending is not None or self._busy), timeout
            )
            self.raise_if_failed()
            if not done:
                raise TimeoutError(f"{self.what} still busy after {timeout} s")

    def close(self, timeout: float | None = None) -> None:
        """Run what is pending (see `flush`, whose failure it raises), then stop the thread."""
        try:
            self.flush(timeout)
        finally:
            with self.lock:
                self._closed = True
                self.lock.notify_all()
            self._thread.join(timeout)

    @property
    def stopped(self) -> bool:
        return not self._thread.is_alive()

    def raise_if_failed(self) -> None:
        if self.error is not None:
            raise Stopped(f"{self.what} failed: {self.error}") from self.error

    def _loop(self) -> None:
        if self._start is not None:
            self._guarded(self._start)
        while self.error is None:
            with self.lock:
                self.lock.wait_for(lambda: self._pending is not None or self._closed, self._idle_s)
                if self._pending is None and self._closed:
                    return
                job, self._pending = self._pending, None
                self._busy = job is not None
            if job is not None:
                self._guarded(functools.partial(self._run, job))
            elif self._idle is not None:
                self._guarded(self._idle)

    def _guarded(self, call: Callable[[], None]) -> None:
        try:
            call()
        except BaseException as e:  # kept for the caller: submit() and flush() raise it
            log.exception("%s failed", self.what)
            with self.lock:
                self.error = e
        finally:
            with self.lock:
                self._busy = False
                self.lock.notify_all()
