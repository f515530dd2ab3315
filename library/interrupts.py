"""Ctrl-C and SIGTERM during training: finish the step, save, flush, exit with a resume hint."""
from __future__ import annotations

import os
import signal
import threading
from typing import Callable, Optional


class StopRequest:
    """The first SIGINT/SIGTERM sets ``signum``; the loop stops after the current optimizer
    step. A second signal runs ``on_force`` (flush logs) and ends the process the default way."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self, on_force: Callable[[], None]) -> None:
        self.signum: Optional[int] = None
        self._on_force = on_force
        self._previous: dict[int, object] = {}
        if threading.current_thread() is threading.main_thread():
            for signum in self.SIGNALS:
                self._previous[signum] = signal.getsignal(signum)
                signal.signal(signum, self._handle)

    def _handle(self, signum: int, frame: object) -> None:
        if self.signum is None:
            self.signum = signum
            print(f"\n{signal.Signals(signum).name}: stopping after the current step (send again to stop now)",
                  flush=True)
            return
        self._on_force()
        self.uninstall()
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)

    @property
    def requested(self) -> bool:
        return self.signum is not None

    @property
    def exit_code(self) -> int:
        """The shell's convention: 128 + signal number."""
        return 128 + (self.signum or 0)

    def uninstall(self) -> None:
        for signum, previous in self._previous.items():
            signal.signal(signum, previous if previous is not None else signal.SIG_DFL)
        self._previous = {}
