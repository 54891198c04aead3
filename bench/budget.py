"""Wall-clock budgets for the GPU suite's phases (a lent GPU runs one command for at most 10 minutes).

A phase checks ``Budget.allows(seconds)`` before each step and leaves out what would not fit; long loops
(the engine's steps, transformers' groups) check ``expired()`` as they go. ``hard_stop()`` is the backstop for
a step that overruns anyway: SIGALRM at the budget's end raises ``BudgetExceeded`` in the main thread, so the
phase still writes what it measured before the device tool kills it.
"""

from __future__ import annotations

import contextlib
import math
import signal
import time
from typing import Iterator


class BudgetExceeded(BaseException):
    """The phase's budget ran out inside a step (raised by the SIGALRM of ``Budget.hard_stop``). A
    BaseException, as KeyboardInterrupt: code that handles any Exception (the engine fails one step's requests
    and goes on, a benchmark case records its error) must not swallow it."""


class Budget:
    """``seconds`` of wall-clock time from now (None: no limit)."""

    def __init__(self, seconds: float | None):
        if seconds is not None and not seconds > 0:
            raise ValueError(f"budget seconds must be positive or None, got {seconds!r}")
        self.seconds = seconds
        self.start = time.monotonic()

    def elapsed(self) -> float:
        return time.monotonic() - self.start

    def remaining(self) -> float:
        return math.inf if self.seconds is None else self.seconds - self.elapsed()

    def allows(self, seconds: float) -> bool:
        """Whether a step expected to take ``seconds`` fits in what is left."""
        return self.remaining() >= seconds

    def expired(self, margin: float = 0.0) -> bool:
        return self.remaining() <= margin

    def hard_stop(self, margin: float = 0.0) -> None:
        """Raise BudgetExceeded in the main thread ``margin`` seconds before the end (SIGALRM; a no-op
        without a limit). ``cancel_hard_stop`` clears it."""
        if self.seconds is None or not hasattr(signal, "SIGALRM"):
            return

        def handler(signum, frame):
            # Raised inside an import it would leave a half-run module behind, inside a report's write a half-written
            # file and a step the phase does not know it was cut from: a second later instead.
            if _deferring or _importing(frame):
                signal.alarm(1)
                return
            raise BudgetExceeded(f"the budget of {self.seconds:.0f} s ran out")

        signal.signal(signal.SIGALRM, handler)
        signal.alarm(max(1, math.ceil(self.remaining() - margin)))

    @staticmethod
    def cancel_hard_stop() -> None:
        if hasattr(signal, "SIGALRM"):
            signal.alarm(0)


_deferring = 0   # deferred_stop()s open


@contextlib.contextmanager
def deferred_stop() -> Iterator[None]:
    """A hard stop that comes inside is raised a second after it instead (the GPU suite writes its report inside:
    a fresh-clone CI's dry run of the headline phase at a 2 s budget had the stop raise in the report's write after
    a step, outside the step that would have recorded the cut, and the phase failed)."""
    global _deferring
    _deferring += 1
    try:
        yield
    finally:
        _deferring -= 1


def _importing(frame) -> bool:
    """Whether ``frame`` runs inside an import (importlib's machinery, or a module's body it runs). An exception raised
    there leaves the modules it had imported so far in sys.modules and drops the one it was importing, whose next
    import then finds them half set up: a hard stop inside the engine's first ``import torch._dynamo`` left every
    later compile of the process failing with "partially initialized module 'torch._dynamo'" (a dry run of the
    headline phase at a 2 s budget)."""
    while frame is not None:
        if frame.f_code.co_filename.startswith("<frozen importlib"):   # (a module's body runs under these too)
            return True
        frame = frame.f_back
    return False

