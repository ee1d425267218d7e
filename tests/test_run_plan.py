"""The run plan: resolved once from the spec, JSON-able for Prefect, and the only source of the model folder."""

from __future__ import annotations

import ast
import dataclasses
import json
from pathlib import Path

import pytest

from slimtune.plan.run_plan import RunPlan, plan_for, resolve_plan
from slimtune.spec.schema import load_spec

ROOT = Path(__file__).resolve().parent.parent
_RESOLVERS = {"local_model_dir", "check_model_dir", "read_config", "resolve_device", "resolve_compute_dtype"}


def test_plan_resolves_the_tiny_spec_and_survives_json(tmp_path):
    spec = load_spec(ROOT / "deployments" / "tiny.yaml")
    spec.output_dir = str(tmp_path)
    plan = resolve_plan(spec)
    assert (Path(plan.model_dir) / "config.json").is_file()
    assert plan.family == plan.config["model_type"] == "llama"
    assert (plan.device, plan.compute_dtype) == ("cpu", "float32")  # tiny.yaml: device cpu, dtype auto
    assert RunPlan(**json.loads(json.dumps(dataclasses.asdict(plan)))) == plan  # a plain task parameter
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.device = "cuda:0"  # type: ignore[misc]
    assert plan_for(spec, plan) is plan


@pytest.mark.parametrize(
    "path",
    sorted(
        str(p.relative_to(ROOT))
        for p in [*(ROOT / "slimtune" / "tasks").glob("*.py"), ROOT / "slimtune" / "flows" / "stages.py"]
    ),
)
def test_tasks_and_stages_do_not_resolve_the_model_themselves(path):
    """They take the flow's plan (`plan_for` resolves one only for callers outside the flow)."""
    tree = ast.parse((ROOT / path).read_text(encoding="utf-8"))
    used = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)} | {
        a.name.split(".")[-1] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) for a in n.names
    }
    assert not used & _RESOLVERS, f"{path} re-derives {sorted(used & _RESOLVERS)}; take a RunPlan instead"
