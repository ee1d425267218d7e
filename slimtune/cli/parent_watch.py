"""Kill a process when the process that started it dies, however it dies: `python -m slimtune.cli.parent_watch PID`.

`slimtune run` starts Prefect's temporary API server with SIGINT and SIGTERM blocked (see
`slimtune.cli.interrupt`), so after a `kill -9` of the CLI nothing stopped it: it was re-parented to PID 1 and
kept running (~200 MB each, one per killed run). Prefect starts that process itself, so it cannot be given
a parent-death signal (`PR_SET_PDEATHSIG` has to be set in the child, and is cleared by fork). Instead a
small watcher is started next to it: it blocks reading a pipe whose only write end the CLI holds; the
kernel closes that end when the CLI exits for any reason, the read returns, and the watcher kills the
server through a pidfd opened while the server was alive (so a reused PID is never hit).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys


def watch(pid: int) -> subprocess.Popen:
    """Start a watcher that kills `pid` when this process exits; keep the returned handle for as long as
    `pid` should live (its stdin is the pipe: closing it, or this process ending, kills `pid`)."""
    return subprocess.Popen(
        [sys.executable, "-m", "slimtune.cli.parent_watch", str(pid)],
        stdin=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )


def _main(pid: int) -> None:
    # Ctrl-C reaches the terminal's whole process group, this watcher included: it must outlive the CLI.
    for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(signum, signal.SIG_IGN)
    try:
        pidfd = os.pidfd_open(pid)  # Linux >= 5.3: refers to this very process even after its PID is reused
    except (AttributeError, OSError):
        pidfd = None
    try:
        while os.read(sys.stdin.fileno(), 4096):  # returns b"" once every write end is closed
            pass
    except OSError:
        pass
    try:
        if pidfd is not None:
            signal.pidfd_send_signal(pidfd, signal.SIGKILL)
        else:  # no pidfd (not Linux): the PID; reuse is possible only if the server had already exited
            os.kill(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass  # already gone


if __name__ == "__main__":
    _main(int(sys.argv[1]))
