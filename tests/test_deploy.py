"""prefect.yaml: generated from the specs, deployable with `prefect deploy --all`, and run by a worker.

The end-to-end test does what docs/deployments.md tells a user to do, against a real
`prefect server start`: create the work pool and the device's concurrency limit, `prefect deploy
--all`, start a process worker, `prefect deployment run finetune/tiny-smoke`; the worker clones the
repository (the pull steps) and the run must complete with the six task runs.
"""

from __future__ import annotations

import importlib.util
import shutil
import subprocess
import time
from pathlib import Path

import yaml
from prefect_server import REPO, start_server, start_worker

from slimtune.spec import STAGES, parse_spec, recheck_paths

_POOL = "gpu-hosts"
_RUN_TIMEOUT_S = 240  # server-side: clone + imports ~30 s, the 4-step tiny pipeline ~90 s on 2 busy cores


def _renderer():
    spec = importlib.util.spec_from_file_location(
        "render_prefect_yaml", REPO / "deployments" / "render_prefect_yaml.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_prefect_yaml_is_generated_from_the_specs():
    assert (REPO / "prefect.yaml").read_text() == _renderer().render(), (
        "prefect.yaml is stale: run python deployments/render_prefect_yaml.py"
    )


def test_deployment_parameters_validate_from_the_clone_root(monkeypatch):
    """Deployed specs arrive without a file: their paths must resolve from the clone root, as the flow does."""
    monkeypatch.chdir(REPO)
    config = yaml.safe_load((REPO / "prefect.yaml").read_text())
    names = set()
    for dep in config["deployments"]:
        spec = recheck_paths(parse_spec(dep["parameters"]["spec"]))
        assert Path(spec.data.path) == REPO / "deployments" / "data" / "tiny_chat.jsonl"
        assert spec.output_dir == "runs"  # relative: the run directory lands in the clone
        assert dep["entrypoint"] == "slimtune/flows/finetune.py:finetune"
        assert dep["work_pool"]["name"] == _POOL
        names.add(dep["name"])
    assert {"tiny", "tiny-smoke", "llama-3.1-8b-chat", "qwen2.5-7b-chat"} <= names
    assert any(s.get("cron") for dep in config["deployments"] for s in dep["schedules"])


def _clone_source(dest: Path) -> Path:
    """A git repository holding the working tree (tracked and untracked, not ignored), on branch main.

    The worker's pull step clones it, so the test runs what would be committed, from a clone.
    """
    files = (
        subprocess.run(
            ["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=REPO, check=True, capture_output=True
        )
        .stdout.decode()
        .split("\0")
    )
    for name in filter(None, files):
        src = REPO / name
        if src.is_file():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / name)
    git = ["git", "-c", "user.name=test", "-c", "user.email=test@localhost"]
    subprocess.run(git + ["init", "-q", "-b", "main"], cwd=dest, check=True)
    subprocess.run(git + ["add", "-A"], cwd=dest, check=True)
    subprocess.run(git + ["commit", "-q", "-m", "snapshot"], cwd=dest, check=True)
    return dest


def test_worker_runs_the_deployed_tiny_pipeline(tmp_path, request):
    source = _clone_source(tmp_path / "source")
    server = start_server(
        tmp_path / "home",
        request.addfinalizer,
        extra_env={"SLIMTUNE_GIT_URL": source.as_uri(), "TRITON_INTERPRET": "1"},
    )
    server.prefect(
        "work-pool",
        "create",
        _POOL,
        "--type",
        "process",
        "--base-job-template",
        str(REPO / "deployments" / "process" / "gpu-hosts.json"),
    )
    server.prefect("work-pool", "set-concurrency-limit", _POOL, "1")
    server.prefect("global-concurrency-limit", "create", "gpu", "--limit", "1")  # the flow's GPU slot
    out = server.prefect("--no-prompt", "deploy", "--all", cwd=REPO)
    assert "finetune/tiny-smoke" in out, out

    workdir = tmp_path / "worker"
    workdir.mkdir()
    worker = start_worker(server, _POOL, request.addfinalizer, cwd=workdir, limit=1)
    # The pool's working_dir (where the clone and its runs/ live) points at /var/lib/slimtune; here at tmp.
    out = server.prefect("deployment", "run", "finetune/tiny-smoke", "--job-variable", f"working_dir={workdir}")
    assert "Created flow run" in out, out

    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId
    from prefect.settings import PREFECT_API_URL, temporary_settings

    with temporary_settings({PREFECT_API_URL: server.url}), get_client(sync_client=True) as client:
        deployment = client.read_deployment_by_name("finetune/tiny-smoke")
        assert [s.schedule.cron for s in deployment.schedules] == ["0 3 * * *"]
        assert client.read_deployment_by_name("finetune/qwen2.5-7b-chat").schedules[0].schedule.cron == "0 2 * * 1"
        # The UI's custom-run form is built from this schema: the spec's sections, with their field help.
        schema = deployment.parameter_openapi_schema
        lora = schema["definitions"]["LoraSpec"]["properties"]["r"]
        assert schema["required"] == ["spec"] and lora["description"] == "LoRA rank (> 0)."
        deadline = time.monotonic() + _RUN_TIMEOUT_S
        run = None
        while time.monotonic() < deadline and worker.poll() is None:
            runs = client.read_flow_runs()
            run = next((r for r in runs if r.deployment_id == deployment.id), None)
            if run is not None and run.state is not None and run.state.is_final():
                break
            time.sleep(2)
        assert run is not None and run.state.is_completed(), (
            f"{run and run.state}\n--- worker ---\n{server.log('worker.log')}"
        )
        tasks = client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[run.id])))
        artifacts = {a.key for a in client.read_artifacts() if a.flow_run_id == run.id}

    assert sorted(t.name.split(" ")[0] for t in tasks) == sorted(STAGES)
    assert all(t.state.is_completed() for t in tasks), [(t.name, t.state.type) for t in tasks]
    assert all("tiny-smoke" in t.name for t in tasks)
    assert run.name.startswith("tiny-smoke: builtin:tiny-llama on tiny_chat.jsonl"), run.name
    assert {"memory-report", "run-report", "tiny-smoke-training"} <= artifacts, artifacts
    # The flow ran in the clone under the working_dir: its run directory is there, not in this checkout.
    assert list(workdir.glob("*/runs/tiny-smoke/report.json")), f"no run directory in a clone under {workdir}"
