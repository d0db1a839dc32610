"""Ctrl-C for a running job.

The first SIGINT raises `KeyboardInterrupt` in the driver's main thread, wherever it waits (Ray's `wait`
included): the run stops there, the job's cleanup (`finally` in `launch.run_job`) tears down the controllers,
releases the placement and shuts Ray down, and the command prints where to resume and exits 130. Stopping at
any moment is safe because checkpoints are atomic (a half-written one is never loaded); the steps after the
newest checkpoint, the one in flight included, are run again on resume. A second SIGINT, while that cleanup
runs, exits the process at once (130) without waiting for it.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from typing import Any

EXIT_INTERRUPTED = 130  # 128 + SIGINT, what a shell reports for a process ended by Ctrl-C


class SigintGuard:
    """Within `with SigintGuard():` the first SIGINT raises KeyboardInterrupt and the second calls
    `os._exit(130)`. Installed from the main thread only (Python delivers signals there); elsewhere a no-op."""

    def __init__(self) -> None:
        self.count = 0
        self._previous: Any = None  # the SIGINT handler this guard replaced, restored on exit

    def _handle(self, signum, frame) -> None:
        self.count += 1
        if self.count > 1:
            os._exit(EXIT_INTERRUPTED)
        print("\nyatt: stopping (Ctrl-C again to exit at once)", file=sys.stderr, flush=True)
        raise KeyboardInterrupt

    def __enter__(self) -> SigintGuard:
        self.count = 0
        if threading.current_thread() is threading.main_thread():  # elsewhere signals cannot be handled
            self._previous = signal.signal(signal.SIGINT, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGINT, self._previous)


def interrupted_message(run_dir: str) -> str:
    """What the command prints after a Ctrl-C: the last completed step (from metrics.jsonl) and the command
    that continues the run, with the newest checkpoint the resume starts from."""
    from yatt_controller import checkpoint

    from yatt_apps.io.rundir import last_step

    step = last_step(run_dir)
    found = checkpoint.latest(os.path.join(run_dir, "checkpoints"))
    where = "from its start" if found is None else f"after the checkpoint of step {found[1].step}"
    head = f"interrupted at step {step}" if step is not None else "interrupted before the first step"
    from yatt_apps.runtime.progress import yatt_command

    return f"{head}; resume with: {yatt_command()} resume {run_dir}\n(the run continues {where})"


GUARD = SigintGuard()  # the `yatt` command's: `cli._run` asks it whether an error followed a Ctrl-C
