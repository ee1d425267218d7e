"""GPU slots on one machine: a `slimtune run` on its temporary server and a run of a Prefect server share the
host's lock files, so neither takes a card the other holds."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading

from slimtune.flows.gpu_slots import _host_gpu_slots

_HOLDER = textwrap.dedent(
    """
    import sys, time
    from prefect import flow
    from slimtune.flows.gpu_slots import gpu_concurrency

    @flow
    def hold():
        with gpu_concurrency("gpu-shared"):
            print("held", flush=True)
            sys.stdin.readline()  # until the test closes stdin

    hold()
    """
)


def test_a_temporary_server_run_holds_the_slots_a_server_run_takes(tmp_path):
    from prefect.settings import PREFECT_HOME, temporary_settings

    env = {k: v for k, v in os.environ.items() if k != "PREFECT_API_URL"}
    env |= {"PREFECT_HOME": str(tmp_path), "PREFECT_SERVER_ANALYTICS_ENABLED": "false"}
    env["PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS"] = "150"  # a loaded 2-core machine is slow to start it
    holder = subprocess.Popen(
        [sys.executable, "-c", _HOLDER], env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert holder.stdout.readline().strip() == "held"
        taken = threading.Event()

        def take() -> None:  # the server path of a run on the same machine: one slot of a one-GPU limit
            with temporary_settings({PREFECT_HOME: tmp_path}), _host_gpu_slots("gpu-shared", 1, 1):
                taken.set()

        thread = threading.Thread(target=take, daemon=True)
        thread.start()
        assert not taken.wait(3), "a server run took the slot a temporary-server run holds"
        holder.stdin.close()
        assert holder.wait(timeout=120) == 0
        assert taken.wait(10), "the slot was not free after its holder ended"
    finally:
        holder.kill()
