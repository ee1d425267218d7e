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

from slimtune.report.artifacts import progress_key
from slimtune.spec.schema import STAGES, parse_spec, recheck_paths

_POOL, _CPU_POOL = "gpu-hosts", "cpu-hosts"
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
        if dep["entrypoint"] == _renderer().EXPORT_ENTRYPOINT:  # no spec of its own: the finetune run passes it
            continue
        spec = recheck_paths(parse_spec(dep["parameters"]["spec"]))
        assert Path(spec.data.path) == REPO / "deployments" / "data" / "tiny_chat.jsonl"
        assert spec.output_dir == "runs"  # relative: the run directory lands in the clone
        assert dep["entrypoint"] == "slimtune/flows/finetune.py:finetune"
        names.add(dep["name"])
    assert {"tiny", "tiny-smoke", "llama-3.1-8b-chat", "qwen2.5-7b-chat"} <= names
    assert any(s.get("cron") for dep in config["deployments"] for s in dep["schedules"])


def test_shipped_schedules_and_pools_fit_what_each_spec_needs():
    """The CPU canary runs nightly on the CPU pool holding the CPU slot, never a GPU worker or a GPU's slot; the GPU
    examples sit on the queue of workers with their GPU count, their schedules off until the spec is the user's."""
    deployments = {d["name"]: d for d in yaml.safe_load((REPO / "prefect.yaml").read_text())["deployments"]}
    cpu = {"name": _CPU_POOL, "work_queue_name": "default", "job_variables": {"env": {"SLIMTUNE_GPU_SLOT": "cpu"}}}
    for name in ("tiny", "tiny-smoke"):
        assert deployments[name]["work_pool"] == cpu
    assert deployments["tiny-smoke"]["schedules"] == [{"cron": "0 3 * * *", "timezone": "UTC", "active": True}]
    assert deployments["tiny-smoke"]["parameters"]["spec"]["lora"]["gradient_checkpointing"] is False  # CPU: no offload
    assert deployments["llama-3.1-8b-chat"]["work_pool"]["work_queue_name"] == "default"
    qwen = deployments["qwen2.5-7b-chat"]
    assert qwen["work_pool"] == {"name": _POOL, "work_queue_name": "gpus-2", "job_variables": {}}
    assert qwen["schedules"] == [{"cron": "0 2 * * 1", "timezone": "UTC", "active": False}]

    # The GPU schedule turns on once the spec names the user's data and repository, and only then.
    active = _renderer().schedule_active
    spec = qwen["parameters"]["spec"]
    mine = {**spec, "data": {"path": "acme/support-chats"}, "export": {"push": {"repo_id": "acme/qwen-support"}}}
    assert active(mine)
    assert not active({**mine, "export": spec["export"]})  # still pushes to your-org/...
    assert not active({**mine, "data": spec["data"]})  # still trains on the shipped sample
    assert active({**mine, "export": {"gguf": ["q8_0"]}})  # no push at all: nothing to own


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
    source = tmp_path / "source"
    server = start_server(  # it boots while the source is cloned
        tmp_path / "home",
        request.addfinalizer,
        extra_env={"SLIMTUNE_GIT_URL": source.as_uri(), "TRITON_INTERPRET": "1"},
        wait=False,
    )
    _clone_source(source)
    server.wait_healthy()
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
    server.prefect(
        "work-pool",
        "create",
        _CPU_POOL,
        "--type",
        "process",
        "--base-job-template",
        str(REPO / "deployments" / "process" / "gpu-hosts.json"),
    )
    workdir = tmp_path / "worker"
    workdir.mkdir()
    # the canary's pool; the worker boots (10-20 s of imports on a busy 2-core machine) while `prefect deploy` runs
    worker = start_worker(server, _CPU_POOL, request.addfinalizer, cwd=workdir, limit=1)
    out = server.prefect("--no-prompt", "deploy", "--all", cwd=REPO)
    assert "finetune/tiny-smoke" in out, out
    # The pool's working_dir (where the clone and its runs/ live) points at /var/lib/slimtune; here at tmp.
    out = server.prefect("deployment", "run", "finetune/tiny-smoke", "--job-variable", f"working_dir={workdir}")
    assert "Created flow run" in out, out

    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId
    from prefect.settings import PREFECT_API_URL, temporary_settings

    with temporary_settings({PREFECT_API_URL: server.url}), get_client(sync_client=True) as client:
        deployment = client.read_deployment_by_name("finetune/tiny-smoke")
        assert [(s.schedule.cron, s.active) for s in deployment.schedules] == [("0 3 * * *", True)]
        qwen = client.read_deployment_by_name("finetune/qwen2.5-7b-chat")
        assert [(s.schedule.cron, s.active) for s in qwen.schedules] == [("0 2 * * 1", False)]
        assert (qwen.work_pool_name, qwen.work_queue_name) == (_POOL, "gpus-2")
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
        # The canary held the CPU slot (the flow creates a missing limit), not the GPU's.
        assert client.read_global_concurrency_limit_by_name("cpu").limit >= 1
        artifacts = {a.key for a in client.read_artifacts() if a.flow_run_id == run.id}

    assert sorted(t.name.split(" ")[0] for t in tasks) == sorted(STAGES)
    assert all(t.state.is_completed() for t in tasks), [(t.name, t.state.type) for t in tasks]
    assert all("tiny-smoke" in t.name for t in tasks)
    assert run.name.startswith("tiny-smoke: builtin:tiny-llama on tiny_chat.jsonl"), run.name
    assert {"memory-report", "run-report", progress_key("tiny-smoke")} <= artifacts, artifacts
    # The flow ran in the clone under the working_dir: its run directory is there, not in this checkout.
    assert list(workdir.glob("*/runs/tiny-smoke/report.json")), f"no run directory in a clone under {workdir}"
