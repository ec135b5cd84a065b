"""How a stage core process learns that it must stop: SIGTERM/SIGINT, or its parent's death.

A Python signal handler runs only when the main thread wakes, and the kernel may deliver a
signal to any thread (numpy's and torch's pools among them), leaving a main thread that is
idle on its queue deaf to it. So the stop signals are blocked in every thread and taken by
one thread with sigwait. For the mask to cover the threads that imports start, the process
must begin with the signals already blocked: its parent starts it inside
``stop_signals_blocked()`` (a child inherits the mask across fork and exec).

A parent that dies without stopping its child (SIGKILL, a crash) must not leave the child
behind: a second thread waits on a pidfd of the parent.
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
import threading
from collections.abc import Callable, Iterator

STOP_SIGNALS = frozenset({signal.SIGTERM, signal.SIGINT})


@contextlib.contextmanager
def stop_signals_blocked() -> Iterator[None]:
    """Block the stop signals in this thread while starting children that inherit the mask.

    The thread's own mask is restored on exit; a signal that arrives meanwhile is delivered
    then, not lost.
    """
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


def start_stop_watchers(stop: Callable[[str], None]) -> None:
    """Call ``stop(reason)`` once, from a daemon thread, on SIGTERM/SIGINT or when the
    parent process exits. Blocks the stop signals in the calling thread (the process
    should have started with them blocked, see the module docstring)."""
    signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
    stopped = threading.Lock()

    def stop_once(reason: str) -> None:
        if stopped.acquire(blocking=False):
            stop(reason)

    def watch_signals() -> None:
        signum = signal.sigwait(STOP_SIGNALS)
        stop_once(signal.Signals(signum).name)

    threading.Thread(target=watch_signals, daemon=True, name="stop-signal-watch").start()
    parent = os.getppid()
    try:
        pidfd = os.pidfd_open(parent)
    except OSError:
        return  # no pidfd support: the parent's shutdown remains the only way out

    def watch_parent() -> None:
        select.select([pidfd], [], [])
        stop_once(f"parent process {parent} exited")

    threading.Thread(target=watch_parent, daemon=True, name="parent-watch").start()
