"""Ctrl-C and SIGTERM during `slimtune run`: stop within seconds with 130 / 143, leaving a resumable run.

What went wrong before: Ctrl-C in a terminal reaches the whole foreground process group, so Prefect's
temporary API server (a child process) died with the CLI's flow still running; the flow then retried its
state reports against the dead server for ~300 s, and SIGTERM had no handler at all. Here:

- the temporary server is started with SIGINT and SIGTERM blocked (the mask is inherited across fork and
  exec, and uvicorn only installs handlers, which a blocked signal never reaches), so a signal to the
  whole group leaves it up and the flow's "Crashed" report goes through at once; the CLI kills it when
  it exits (it keeps nothing that matters: the run history is in SQLite, which survives a kill), and a
  watcher (`slimtune.cli.parent_watch`) kills it when the CLI dies without exiting (kill -9, the OOM killer);
- the first SIGINT raises `Interrupted` in the main thread: training stops where it is, the flow run
  ends Crashed, and the CLI prints one line. SIGTERM goes through Prefect's own bridge while the flow
  runs (it raises TerminationSignal, records the crash, then re-sends the signal to our handler);
- a second signal, or the first one not done within `GRACE_S`, exits the process immediately. That is
  safe because every checkpoint is published atomically: the next run resumes from the last complete one.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import signal
import sys
import threading
from collections.abc import Callable, Iterator

GRACE_S = 8.0  # the run must be gone within 10 s of the first signal
_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class Interrupted(KeyboardInterrupt):
    """A SIGINT or SIGTERM; a KeyboardInterrupt so that Prefect's engines record a crash and re-raise it."""

    def __init__(self, signum: int) -> None:
        self.signum = signum
        super().__init__(signal.Signals(signum).name)


def exit_code(signum: int) -> int:
    """The shell's code for death by `signum`: 130 for SIGINT, 143 for SIGTERM.

    SIGTERM keeps its own code rather than 130 so that a scheduler (systemd, Kubernetes, a Prefect worker)
    can tell "I stopped it" from "a person pressed Ctrl-C".
    """
    return 128 + signum


def _stop_prefect_server() -> None:
    """Kill the temporary server: it ignores SIGTERM (blocked), which Prefect's own stop() would wait 5 s on."""
    from prefect.server.api.server import SubprocessASGIServer

    for server in list(SubprocessASGIServer._instances.values()):
        if server.server_process is not None and server.server_process.poll() is None:
            server.server_process.kill()
            server.server_process.wait()
        for watcher in getattr(server, "watchers", []):  # its server is gone: let it exit now
            watcher.stdin.close()


def _force_exit(signum: int, why: str) -> None:
    print(
        f"slimtune: error: interrupted ({signal.Signals(signum).name}, {why}); the run can be resumed", file=sys.stderr
    )
    with contextlib.suppress(Exception):
        _stop_prefect_server()
    sys.stderr.flush()
    os._exit(exit_code(signum))


START_LIMIT_SETTING = "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS"


class ServerStartTimeout(RuntimeError):
    """The temporary Prefect server did not answer within its start limit; the message names the setting."""


def start_shielded_prefect_server() -> None:
    """Start Prefect's temporary API server now, with SIGINT blocked in it and bound to this process's life
    (`slimtune.cli.parent_watch`), when the run will use one.

    Raises:
        ServerStartTimeout: it did not answer within PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS.
    """
    from prefect.settings import (
        PREFECT_API_URL,
        PREFECT_SERVER_EPHEMERAL_ENABLED,
        PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS,
    )

    if PREFECT_API_URL.value() or not PREFECT_SERVER_EPHEMERAL_ENABLED.value():
        return
    from prefect.server.api.server import SubprocessASGIServer

    from slimtune.cli.parent_watch import watch

    class _ParentBound(SubprocessASGIServer):
        """Each server process Prefect starts (it starts another when the port was taken) gets a watcher."""

        def _run_uvicorn_command(self):
            process = super()._run_uvicorn_command()
            self.watchers = [*getattr(self, "watchers", []), watch(process.pid)]
            return process

    blocked = signal.pthread_sigmask(signal.SIG_BLOCK, set(_SIGNALS))
    try:
        # The instance Prefect's client uses (its constructor returns the one instance per port): it finds
        # it running. An instance made earlier keeps Prefect's class, and so has no watcher.
        _ParentBound().start()
    except RuntimeError as e:
        if not str(e).startswith("Timed out"):
            raise
        _stop_prefect_server()
        limit = PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS.value()
        raise ServerStartTimeout(
            f"the temporary Prefect server did not answer within {limit} s ({START_LIMIT_SETTING}); on a busy "
            f"machine raise it (e.g. {START_LIMIT_SETTING}=300) or set PREFECT_API_URL to a running server"
        ) from None
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, blocked)
        atexit.register(_stop_prefect_server)  # after start()'s own: atexit runs last in, first out


def start_prefect_server_in_background() -> Callable[[], None]:
    """`start_shielded_prefect_server` on a daemon thread; returns the call that waits for it and raises what it
    raised.

    The server boots in a process of its own, so on a machine with a free core it comes up while this one
    imports torch and transformers for the checks and the flow (~12 s on an H200 host, where the server took
    ~9 s after them). The signal mask is the starting thread's, which the server inherits, so the main thread
    keeps taking Ctrl-C; a daemon thread never holds up an exit (bad input found meanwhile), and the server's
    watcher (`slimtune.cli.parent_watch`) ends it with this process.
    """
    failed: list[BaseException] = []

    def start() -> None:
        try:
            start_shielded_prefect_server()
        except BaseException as e:  # handed to the main thread, which raises it
            failed.append(e)

    thread = threading.Thread(target=start, name="slimtune-server", daemon=True)
    thread.start()

    def wait() -> None:
        thread.join()
        if failed:
            raise failed[0]

    return wait


def _watch(read_fd: int, grace_s: float) -> None:
    """Sees each SIGINT/SIGTERM the moment it arrives (through the wakeup fd, written by the C-level handler),
    even while the main thread sits in a long torch call or Prefect's own SIGTERM handler is installed:
    the grace period starts at the signal, and a second signal exits at once."""
    first: int | None = None
    while True:
        try:
            data = os.read(read_fd, 64)
        except OSError:
            return
        for signum in data:
            if signum not in _SIGNALS:
                continue
            if first is not None:
                # a second Ctrl-C forces the exit; a repeated SIGTERM does not, because Prefect's SIGTERM bridge
                # re-sends the signal to this process once it has recorded the crash (the deadline still holds)
                if signum == signal.SIGINT:
                    _force_exit(first, "second signal")
                continue
            first = signum
            timer = threading.Timer(grace_s, _force_exit, args=(signum, f"not stopped within {grace_s:.0f} s"))
            timer.daemon = True
            timer.start()


@contextlib.contextmanager
def interruptible(grace_s: float = GRACE_S) -> Iterator[None]:
    """Turn SIGINT/SIGTERM into `Interrupted` in the main thread, with a forced exit as the fallback."""

    def handler(signum: int, frame) -> None:
        raise Interrupted(signum)

    read_fd, write_fd = os.pipe()
    os.set_blocking(write_fd, False)
    previous_fd = signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)
    threading.Thread(target=_watch, args=(read_fd, grace_s), name="slimtune-signals", daemon=True).start()
    previous = {s: signal.signal(s, handler) for s in _SIGNALS}
    try:
        yield
    finally:
        for s, h in previous.items():
            signal.signal(s, h)
        signal.set_wakeup_fd(previous_fd)


def exit_now(code: int) -> None:
    """End an interrupted run now: stop the Prefect server and skip the interpreter's teardown and exit
    handlers. Measured on the busy 2-core machine: teardown spent ~9 s garbage-collecting the model, and
    Prefect's exit handlers 2 s more. The flow run's Crashed state is already recorded by then; at most the
    last log lines of the run miss the Prefect UI."""
    _stop_prefect_server()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
