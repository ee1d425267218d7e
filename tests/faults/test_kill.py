"""SIGKILL of the flow-run process mid-task, under a real Prefect server and process worker.

One chain of runs of the real finetune deployment (`kill_flow.py`), each killed at a different point:
  run 0 at training step 3 (checkpoint-2 complete)  -> the crash hook re-submits it (micro-batch halved)
  run 1 mid-write of the merged shard                -> the crash hook re-submits it again
  run 2 mid-write of the GGUF                        -> the hook's bound (2) is reached: it stays Crashed
  run 3 a plain re-run, submitted once run 2 crashed -> completes (beside the hook's last call)
What each killed process had on disk is recorded by the process itself just before it dies.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest
from faultlib import SAVE_STEPS, TRAIN_RTOL, adapter_diff, check_published, leftovers, spec_dict
from kill_flow import KILL_AT_STEP
from prefect_server import start_server, start_worker

_HERE = Path(__file__).resolve().parent
_REPO = _HERE.parents[1]
_POOL = "faults-pool"
_STAGES = ("train_step", "merge_write", "gguf_write")
# Each flow-run process imports torch, transformers and Prefect (~20 s on a busy 2-core machine) before
# it works; a chain of four runs of the tiny pipeline has taken ~3 minutes.
_CHAIN_TIMEOUT_S = 420
# The chain's runs hold a GPU slot of their own limit, with one slot per run: each killed run leaves its server
# lease behind (nothing revokes it for 60 s, slimtune.flows.gpu_slots), and on one slot every later run waited for
# it: 79-121 s in all of a 4.5-4.7 minute chain on 2 cores (23-60 s per run, longer the faster the run starts),
# 1 s with a slot per run. Those waits are not what this chain is about; the lease's expiry and the host lock a
# kill frees are tests/faults/test_gpu_slot_pause.py's and test_kill_cli.py's. The runs never overlap: each one
# starts after the last has ended.
_SLOT = "faults-kill-chain"
_SLOTS = len(_STAGES) + 1


@pytest.fixture(scope="module")
def chain(tmp_path_factory, request, reference_run):
    """Run the kill chain; returns the flow runs, the kill snapshots, the run dir and the logs."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import GlobalConcurrencyLimitCreate, WorkPoolCreate
    from prefect.client.schemas.filters import DeploymentFilter, DeploymentFilterId
    from prefect.settings import PREFECT_API_URL, temporary_settings
    from prefect.workers.process import ProcessWorker

    home = tmp_path_factory.mktemp("prefect-home")
    plan = tmp_path_factory.mktemp("plan")
    out = tmp_path_factory.mktemp("killed")
    run_dir = out / "faults"
    (plan / "run_dir.txt").write_text(str(run_dir))
    for n, point in enumerate(_STAGES, 1):
        (plan / f"{n}-{point}.kill").touch()
    # The worker's flow runs import kill_flow from this folder, and read the kill plan from the environment.
    pythonpath = os.pathsep.join([str(_HERE), str(_REPO), os.environ.get("PYTHONPATH", "")])
    server = start_server(
        home,
        request.addfinalizer,
        extra_env={"PYTHONPATH": pythonpath, "SLIMTUNE_FAULT_PLAN": str(plan), "SLIMTUNE_GPU_SLOT": _SLOT},
    )
    url = server.url

    import kill_flow

    def logs() -> str:
        return server.log("worker.log")

    def hook_gave_up() -> bool:
        # the whole log: the re-run logs beside the hook, and its lines push the hook's out of `logs()`'s tail
        return "giving up" in (server.home / "worker.log").read_text(errors="replace")

    with temporary_settings({PREFECT_API_URL: url}):
        with get_client(sync_client=True) as client:
            client.create_work_pool(
                WorkPoolCreate(
                    name=_POOL, type="process", base_job_template=ProcessWorker.get_default_base_job_template()
                )
            )
            client.create_global_concurrency_limit(GlobalConcurrencyLimitCreate(name=_SLOT, limit=_SLOTS))
        # The worker boots (its imports: 10-20 s on a busy 2-core machine) while the deployment is made.
        worker = start_worker(server, _POOL, request.addfinalizer)
        deployment_id = kill_flow.finetune.from_source(source=str(_HERE), entrypoint="kill_flow.py:finetune").deploy(
            name="faults", work_pool_name=_POOL, print_next_steps=False
        )

        def wait(count: int) -> list:
            deadline = time.monotonic() + _CHAIN_TIMEOUT_S
            while time.monotonic() < deadline and worker.poll() is None:
                runs = client.read_flow_runs(
                    deployment_filter=DeploymentFilter(id=DeploymentFilterId(any_=[deployment_id]))
                )
                if len(runs) >= count and all(r.state and r.state.is_final() for r in runs):
                    return sorted(runs, key=lambda r: r.created)
                time.sleep(1)
            pytest.fail(f"the kill chain did not finish ({count} runs expected)\n{logs()}")

        with get_client(sync_client=True) as client:
            client.create_flow_run_from_deployment(deployment_id, parameters={"spec": spec_dict(out)})
            runs = wait(3)
            killed = {
                p.name.split(".")[0].split("-", 1)[1]: json.loads(p.read_text()) for p in plan.glob("*.snapshot.json")
            }
            # The plain re-run starts as soon as run 2 has crashed, while the crash hook's process loads the flow to
            # end the chain (10-15 s on 2 cores); run 2 is dead and holds nothing the re-run needs.
            client.create_flow_run_from_deployment(deployment_id, parameters={"spec": spec_dict(out)})
            # The hook ends the chain saying "giving up"; a hook that ignored its bound would have re-submitted instead.
            deadline = time.monotonic() + 120
            while not hook_gave_up() and time.monotonic() < deadline:
                time.sleep(1)
            assert hook_gave_up(), logs()
            runs = wait(4)
            assert len(runs) == 4, [r.name for r in runs]
            # the 4th run is the plain re-run, not a re-submission
            assert not any(t.startswith("resubmit-") for t in runs[3].tags), [r.tags for r in runs]
    return {"runs": runs, "killed": killed, "run_dir": run_dir, "logs": logs(), "plan": plan}


def _state(run) -> str:
    return run.state.type.value if run.state else "?"


@pytest.mark.fault(
    "Process killed (SIGKILL)",
    stage="packed_sft",
    expect="crash hook re-submits; training resumes from the last checkpoint, losing at most "
    "one checkpoint interval; adapter equal to a clean run within 2e-2",
)
def test_kill_during_training(chain, reference_run, observe):
    runs, killed = chain["runs"], chain["killed"]
    assert [_state(r) for r in runs[:3]] == ["CRASHED"] * 3, ([_state(r) for r in runs], chain["logs"])
    assert "resubmit-1" in runs[1].tags and "resubmit-2" in runs[2].tags, [r.tags for r in runs]
    snap = killed["train_step"]
    assert snap["global_step"] == KILL_AT_STEP
    assert snap["published_problems"] == [], snap["published_problems"]
    assert not any(k.startswith("adapter/") for k in snap["tree"]), "an adapter was published mid-training"
    # run 1 wrote this report before it was killed in the merge
    resumed = killed["merge_write"]["train_report"]
    assert resumed["resumed_from"] and resumed["resumed_from"].endswith(f"checkpoint-{SAVE_STEPS}"), resumed
    lost = snap["global_step"] - int(resumed["resumed_from"].rsplit("-", 1)[1])
    assert 0 <= lost <= SAVE_STEPS
    assert resumed["steps"] == 4 and resumed["micro_batch_size"] == 2
    worst, rel = adapter_diff(chain["run_dir"] / "adapter", reference_run["run_dir"] / "adapter")
    observe(
        f"killed at step {snap['global_step']}, resumed from step {SAVE_STEPS} ({lost} step lost) at "
        f"micro-batch 2; adapter vs clean run: relative L2 {rel:.1e}"
    )
    assert rel < TRAIN_RTOL  # the re-submitted run halves the micro-batch; see faultlib.TRAIN_RTOL


@pytest.mark.fault(
    "Process killed (SIGKILL)",
    stage="dequant_merge",
    expect="merged/ never published half-written; the re-run cleans the temporary folder and merges again",
)
def test_kill_during_merge(chain, observe):
    snap = chain["killed"]["merge_write"]
    assert not any(k.startswith("merged/") for k in snap["tree"]), "merged/ existed while a shard was half written"
    tmp = [p for p in snap["leftovers"] if p.startswith(".merged.tmp-")]
    assert tmp, f"the kill did not land inside the merge's temporary folder: {snap['leftovers']}"
    assert snap["published_problems"] == []
    final = chain["run_dir"]
    observe(
        f"at the kill: {tmp[0].split('/')[0]} held the partial shard; after the re-runs: leftovers "
        f"{leftovers(final) or 'none'}"
    )
    assert check_published(final) == []
    stale = [p for p in leftovers(final) if p.startswith(".merged")]
    assert stale == [], f"temporary merge folders of the killed run are still there: {stale}"


@pytest.mark.fault(
    "Process killed (SIGKILL)",
    stage="gguf_convert_and_push",
    expect="no half-written .gguf published; the re-run cleans the temporary file and completes",
)
def test_kill_during_gguf(chain, reference_run, observe):
    snap = chain["killed"]["gguf_write"]
    assert not any(k.startswith("gguf/") and k.endswith(".gguf") and "/." not in k for k in snap["tree"])
    tmp = [p for p in snap["leftovers"] if p.startswith("gguf/.")]
    assert tmp, f"the kill did not land inside the GGUF's temporary file: {snap['leftovers']}"
    last = chain["runs"][3]
    assert last.state.is_completed(), (last.state, chain["logs"])
    final = chain["run_dir"]
    assert check_published(final) == []
    observe(f"at the kill: {tmp[0]} partial; re-run completed; leftovers {leftovers(final) or 'none'}")
    assert [p for p in leftovers(final) if p.startswith("gguf/")] == []


@pytest.mark.fault(
    "Process killed (SIGKILL)",
    stage="all",
    expect="after the re-run no temporary file or folder is left anywhere in the run dir",
)
def test_kill_leaves_no_temporaries(chain, observe):
    final = chain["run_dir"]
    assert chain["runs"][3].state.is_completed(), chain["logs"]
    left = leftovers(final)
    observe(f"leftovers after the completed re-run: {left or 'none'}")
    assert left == []
