"""A real `prefect server start` and `prefect worker start` as subprocesses, for tests that need them.

Deployments, workers, schedules, crash hooks and the UI only exist with a real server; the in-process
test harness has none of them. Every process starts in its own session so that `stop` ends it and
every child it spawned (flow runs, torchrun) by process group.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parent.parent
# A loaded 2-core machine takes 10-60 s to start the server (migrations, then the UI's static files).
_START_TIMEOUT_S = 150


@dataclass
class Server:
    """A running server: its API URL, the environment that points clients at it, and its home."""

    url: str
    env: dict[str, str]
    home: Path
    proc: subprocess.Popen

    def prefect(self, *args: str, cwd: Path | None = None, timeout: float = 180) -> str:
        """Run the `prefect` CLI against this server; returns its output, fails with it on a non-zero exit."""
        done = subprocess.run(
            [sys.executable, "-m", "prefect", *args],
            env=self.env,
            cwd=cwd or self.home,
            capture_output=True,
            text=True,
            timeout=timeout,
        )
        if done.returncode != 0:
            raise AssertionError(
                f"prefect {' '.join(args)} exited {done.returncode}:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
            )
        return done.stdout + done.stderr

    def create_process_pool(self, name: str, base_job_template: Path | None = None) -> None:
        """`prefect work-pool create NAME --type process [--base-job-template FILE]`, made through the client in
        this process: the CLI spends ~3 s of CPU on its imports for this one request."""
        from prefect.client.orchestration import get_client
        from prefect.client.schemas.actions import WorkPoolCreate
        from prefect.settings import PREFECT_API_URL, temporary_settings
        from prefect.workers.process import ProcessWorker

        template = (
            json.loads(base_job_template.read_text())
            if base_job_template is not None
            else ProcessWorker.get_default_base_job_template()
        )
        with temporary_settings({PREFECT_API_URL: self.url}), get_client(sync_client=True) as client:
            client.create_work_pool(WorkPoolCreate(name=name, type="process", base_job_template=template))

    def log(self, name: str) -> str:
        """The tail of a process log written under the server's home."""
        path = self.home / name
        return path.read_text(errors="replace")[-4000:] if path.is_file() else ""

    def wait_healthy(self) -> None:
        """Block until the API answers; fails with the server's log if it exits or takes over `_START_TIMEOUT_S`."""
        deadline = time.monotonic() + _START_TIMEOUT_S
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if self.proc.poll() is not None:
                raise AssertionError(f"prefect server exited:\n{self.log('server.log')}")
            time.sleep(0.5)
        raise AssertionError(
            f"prefect server did not become healthy in {_START_TIMEOUT_S} s:\n{self.log('server.log')}"
        )


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def migrated_db() -> Path:
    """An empty Prefect database already migrated to the installed Prefect's schema, made once per machine.

    A server on a fresh home runs every Alembic migration before it answers: ~10 s of CPU on a 2-core machine,
    paid by each of the suite's servers. Each home gets a copy of this file instead; the server still runs
    `alembic upgrade` at start, which finds nothing to do. Cached outside the checkout, keyed by Prefect's
    version, and renamed into place only when complete.
    """
    import prefect

    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "slimtune-tests"
    target = cache / f"prefect-{prefect.__version__}-empty.db"
    if target.is_file():
        return target
    cache.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cache) as tmp:
        env = {**os.environ, "PREFECT_HOME": tmp, "PREFECT_SERVER_ANALYTICS_ENABLED": "false"}
        env.pop("PREFECT_API_DATABASE_CONNECTION_URL", None)
        done = subprocess.run(
            [sys.executable, "-m", "prefect", "server", "database", "upgrade", "-y"],
            env=env,
            capture_output=True,
            text=True,
            timeout=600,
        )
        if done.returncode != 0:
            output = f"{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
            raise AssertionError(f"prefect server database upgrade exited {done.returncode}:\n{output}")
        os.replace(Path(tmp) / "prefect.db", target)
    return target


def seed_home(home: Path) -> Path:
    """Create the PREFECT_HOME `home` with a migrated, empty database (unless it has one): the server that
    starts there, ours or the temporary one of `slimtune run`, skips the migrations."""
    home.mkdir(parents=True, exist_ok=True)
    if not (home / "prefect.db").exists():
        shutil.copyfile(migrated_db(), home / "prefect.db")
    return home


def start(cmd: list[str], env: dict[str, str], log: Path, cwd: Path | None = None) -> subprocess.Popen:
    """Start `cmd` in its own session, output to `log`."""
    return subprocess.Popen(
        cmd, env=env, cwd=cwd, stdout=log.open("wb"), stderr=subprocess.STDOUT, start_new_session=True
    )


def stop(proc: subprocess.Popen) -> None:
    """End `proc` and its process group: SIGTERM, then SIGKILL after 10 s."""
    if proc.poll() is not None:
        return
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def start_server(
    home: Path,
    finalize: Callable[[Callable[[], None]], None],
    *,
    ui: bool = False,
    extra_env: dict[str, str] | None = None,
    wait: bool = True,
) -> Server:
    """Start `prefect server start` on a free port of 127.0.0.1 with its home in `home`; wait until healthy.

    Args:
        finalize: registers the teardown (pytest's `request.addfinalizer`).
        ui: also serve the UI (at the server's root URL); off by default, it only slows the start.
        wait: False returns at once, so that the caller works while the server boots (10-60 s on a loaded
            2-core machine) and calls `Server.wait_healthy` before its first request.
    """
    seed_home(home)
    port = free_port()
    url = f"http://127.0.0.1:{port}/api"
    env = {
        **os.environ,
        "PREFECT_HOME": str(home),
        "PREFECT_API_URL": url,
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        "PREFECT_UI_ENABLED": "true" if ui else "false",
        "PREFECT_UI_API_URL": url,
        "PREFECT_WORKER_QUERY_SECONDS": "1",
        "PREFECT_WORKER_PREFETCH_SECONDS": "1",
        "HF_HUB_OFFLINE": "1",
        "PYTHONPATH": os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p),
        **(extra_env or {}),
    }
    proc = start(
        [sys.executable, "-m", "prefect", "server", "start", "--host", "127.0.0.1", "--port", str(port)],
        env,
        home / "server.log",
    )
    finalize(lambda: stop(proc))
    server = Server(url, env, home, proc)
    if wait:
        server.wait_healthy()
    return server


def start_worker(
    server: Server,
    pool: str,
    finalize: Callable[[Callable[[], None]], None],
    *,
    cwd: Path | None = None,
    limit: int | None = None,
    log: str = "worker.log",
) -> subprocess.Popen:
    """Start a process worker on `pool`; its log is `log` under the server's home (one per worker)."""
    cmd = [sys.executable, "-m", "prefect", "worker", "start", "--pool", pool, "--type", "process"]
    if limit is not None:
        cmd += ["--limit", str(limit)]
    worker = start(cmd, server.env, server.home / log, cwd=cwd)
    finalize(lambda: stop(worker))
    return worker
