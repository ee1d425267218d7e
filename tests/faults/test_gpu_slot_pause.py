"""A run paused past its GPU lease (SIGSTOP, Ctrl-Z, a VM freeze) keeps its slot while it lives.

The holder is a real process holding the slot against a real `prefect server start` (60 s lease, the
server's minimum; the in-process test harness runs no repossessor); it is SIGSTOPped until the server has
revoked that lease (the limit's active slots drop to 0), which is where a second run used to take the card.
The second acquirer must wait while the holder lives and get the slot once the holder is killed.
"""

from __future__ import annotations

import os
import queue
import signal
import subprocess
import sys
import threading
import time

import httpx
import pytest
from prefect_server import Server, start_server

# With --on-go it imports first and takes the slot on the first line of its stdin, so that its imports (10-25 s on a
# busy 2-core machine) overlap the wait for the lease's revocation instead of following it.
_TAKE = """import sys
from slimtune.flows.gpu_slots import gpu_concurrency
if sys.argv[1:] == ["--on-go"]:
    sys.stdin.readline()
with gpu_concurrency("gpu"):
    print("held", flush=True)
    sys.stdin.read()
"""
_REVOKE_WAIT_S = 120.0  # the lease (60 s) + the repossessor's loop (2 s here) + room for a loaded machine
_BLOCKED_S = 8.0


@pytest.fixture
def server(tmp_path, request) -> Server:
    """A real server whose repossessor looks for expired leases every 2 s (default 15 s)."""
    return start_server(
        tmp_path / "prefect", request.addfinalizer, extra_env={"PREFECT_SERVER_SERVICES_REPOSSESSOR_LOOP_SECONDS": "2"}
    )


def _active_slots(server: Server) -> int:
    return httpx.get(f"{server.url}/v2/concurrency_limits/gpu", timeout=10).json()["active_slots"]


class _Taker:
    """A process that takes the slot (at once, or on `go` with on_go) and says "held"; its stdout is read on one
    thread (readline blocks)."""

    def __init__(self, server: Server, on_go: bool = False) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-c", _TAKE, *(["--on-go"] if on_go else [])],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=server.env,
        )
        self.lines: queue.Queue[str] = queue.Queue()
        threading.Thread(target=lambda: [self.lines.put(line) for line in self.proc.stdout], daemon=True).start()

    def go(self) -> None:
        """Take the slot now (a taker started with on_go)."""
        self.proc.stdin.write("\n")
        self.proc.stdin.flush()

    def held(self, timeout: float) -> bool:
        """Whether it said "held" within `timeout` seconds."""
        try:
            return self.lines.get(timeout=timeout).strip() == "held"
        except queue.Empty:
            return False


@pytest.mark.fault(
    "Two runs, one GPU: holder paused past its lease",
    stage="all",
    expect="a SIGSTOPped holder whose server lease was revoked keeps the slot; it is freed when the holder dies",
)
def test_paused_holder_keeps_the_gpu_slot(server, observe):
    holder = _Taker(server)
    second = None
    try:
        assert holder.held(120), "the holder did not get the free slot"
        os.kill(holder.proc.pid, signal.SIGSTOP)
        stopped = time.monotonic()
        second = _Taker(server, on_go=True)  # it imports while the lease runs out; it asks for the slot on go()
        while _active_slots(server) and time.monotonic() - stopped < _REVOKE_WAIT_S:
            time.sleep(1.0)
        revoked = time.monotonic() - stopped
        assert _active_slots(server) == 0, f"the server did not revoke the paused holder's lease in {revoked:.0f} s"
        second.go()
        assert not second.held(_BLOCKED_S), "a second run took the GPU slot of a live, paused holder"
        holder.proc.kill()
        holder.proc.wait()
        killed = time.monotonic()
        assert second.held(60), "the slot was not freed when its paused holder died"
        observe(
            f"lease revoked {revoked:.0f} s into the pause; second acquirer blocked {_BLOCKED_S:.0f} s while the "
            f"holder lived, got the slot {time.monotonic() - killed:.1f} s after the holder was killed"
        )
    finally:
        for proc in (holder.proc, second and second.proc):
            if proc is not None and proc.poll() is None:
                proc.kill()
                proc.wait()
