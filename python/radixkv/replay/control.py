"""What drives a replay's loop: Ctrl-C as a request to stop between requests,
and the progress bar."""

from __future__ import annotations

import math
import signal
import sys
import threading
from typing import Optional, Sequence

from tqdm import tqdm

from radixkv.replay.traces import Request


def progress_bar(total: int, enabled: bool) -> tqdm:
    """The replay's progress bar on stderr (tqdm): requests done, their rate and
    the time left. It shows once a run has taken a second. On a terminal it
    redraws up to ten times a second; in a log (stderr not a terminal) at
    most once a second and once a percent, a hundred updates in all."""
    if sys.stderr.isatty():
        pace = dict(mininterval=0.1, dynamic_ncols=True)
    else:
        # tqdm's monitor would drop miniters to 1 after maxinterval without an update.
        pace = dict(mininterval=1.0, miniters=max(1, total // 100), maxinterval=math.inf)
    return tqdm(
        total=total,
        desc="replay",
        unit="req",
        file=sys.stderr,
        delay=1.0,
        disable=not enabled or total == 0,
        **pace,
    )


class StopOnCtrlC:
    """Ctrl-C as a request to stop between requests. The first sets `stop`
    and gives SIGINT back to Python, so a second raises KeyboardInterrupt as
    usual. A request is never cut half-way: an exception landing inside the
    cache's bookkeeping (a copy started but not yet recorded) would leave
    the tiers in a state no later call can make sense of.

    Nested, the inner `with` gets the outer one (one flag for a whole run: a
    sweep's points, the steps after the last request). Only Python's
    default handler is replaced, and only on the main thread (the only one
    signals reach); elsewhere nothing changes."""

    _active: Optional["StopOnCtrlC"] = None

    def __init__(self) -> None:
        self.stop = False
        self._installed = False

    def __enter__(self) -> "StopOnCtrlC":
        if threading.current_thread() is not threading.main_thread():
            return self
        if StopOnCtrlC._active is not None:
            return StopOnCtrlC._active
        if signal.getsignal(signal.SIGINT) is signal.default_int_handler:
            signal.signal(signal.SIGINT, self._on_sigint)
            self._installed = True
            StopOnCtrlC._active = self
        return self

    def _on_sigint(self, signum, frame) -> None:
        self.stop = True
        signal.signal(signal.SIGINT, signal.default_int_handler)

    def __exit__(self, *exc) -> None:
        if self._installed:
            StopOnCtrlC._active = None
            signal.signal(signal.SIGINT, signal.default_int_handler)


class UntilStopped:
    """The requests in order, moving the progress bar, until Ctrl-C asks the
    run to stop; `interrupted` then says requests were left."""

    def __init__(self, requests: Sequence[Request], bar: tqdm, ctrl_c: StopOnCtrlC):
        self.requests, self.bar, self.ctrl_c = requests, bar, ctrl_c
        self.interrupted = False

    def __iter__(self):
        for i, req in enumerate(self.requests):
            if self.ctrl_c.stop:
                self.interrupted = True
                return
            yield i, req
            self.bar.update()
