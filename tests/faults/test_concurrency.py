"""Two flow runs started against one GPU slot run one after the other, not side by side.

The slot is the Prefect global concurrency limit the design names (`prefect gcl create gpu --limit 1`;
DESIGN.md, `slimtune.flows.gpu_slots.gpu_concurrency`). The model stages are stubbed with tasks that hold for
2 s, so the test measures the flow's own locking and runs in seconds.
"""

from __future__ import annotations

import threading

import pytest
from faultlib import WIRING_ONLY, run_finetune, spec_dict, stub_model_stages

_HOLD_S = 2.0


@pytest.fixture
def gpu_limit(prefect_harness, monkeypatch):
    """A one-slot limit of this test's own (SLIMTUNE_GPU_SLOT names it): the session's server may already hold
    a "gpu" limit, which any flow run creates when missing."""
    import uuid

    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import GlobalConcurrencyLimitCreate

    name = f"gpu-{uuid.uuid4().hex[:8]}"
    monkeypatch.setenv("SLIMTUNE_GPU_SLOT", name)
    with get_client(sync_client=True) as client:
        client.create_global_concurrency_limit(GlobalConcurrencyLimitCreate(name=name, limit=1))
    yield name
    with get_client(sync_client=True) as client:
        client.delete_global_concurrency_limit_by_name(name)


@pytest.mark.fault(
    "Concurrency: two runs, one GPU slot",
    stage="all",
    expect="the second run's stages start after the first run's stages end",
)
def test_two_runs_on_one_slot_do_not_overlap(tmp_path, gpu_limit, observe):
    spans: list[tuple[str, str, float, float]] = []
    errors: list[BaseException] = []

    def run(name: str) -> None:
        try:
            run_finetune({**spec_dict(tmp_path, **WIRING_ONLY), "name": name})
        except BaseException as e:
            errors.append(e)

    with pytest.MonkeyPatch.context() as mp:
        stub_model_stages(mp, spans, seconds=_HOLD_S)
        threads = [threading.Thread(target=run, args=(n,)) for n in ("first", "second")]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=300)
    assert not errors, errors
    windows = {
        n: (min(s[2] for s in spans if s[0] == n), max(s[3] for s in spans if s[0] == n)) for n in ("first", "second")
    }
    (a0, a1), (b0, b1) = sorted(windows.values())
    overlap = max(0.0, min(a1, b1) - b0)
    observe(f"GPU-stage windows overlap by {overlap:.1f} s")
    assert overlap == 0.0, f"both runs held the GPU stages at once for {overlap:.1f} s: {windows}"
