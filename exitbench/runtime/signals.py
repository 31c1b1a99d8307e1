"""SIGTERM as a stop the program can act on: a scheduler's `kill`, a CI timeout or `docker stop` ends a sweep the
way Ctrl-C does (claims released, finished cells kept, a line saying so), instead of silently."""
from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator


class Terminated(BaseException):
    """Raised in the main thread on SIGTERM. A BaseException, as KeyboardInterrupt is, so that no `except
    Exception` on the way (lm-eval's, ours) takes it for an error to handle and carry on."""


@contextlib.contextmanager
def terminate_raises() -> Iterator[None]:
    """For the block's duration, SIGTERM raises Terminated; the previous handler is restored after. A no-op off
    the main thread, where Python cannot install handlers."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def stop(signum, frame):
        raise Terminated()

    previous = signal.signal(signal.SIGTERM, stop)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
