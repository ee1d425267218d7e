"""`slimtune run`'s start-up: what the CLI and the flow import.

The CLI module is imported by every command (`--help`, `init`, a spec error that exits 2), so it loads no ML
library and no Prefect; the flow's imports load no plotting, tracker, llama.cpp or Ray module (those are imported
where used: Ray only for a `train.cluster` run), nor transformers' Trainer (the packed_sft stage imports it).
"""

from __future__ import annotations

import json
import subprocess
import sys

_FOREIGN = ("matplotlib", "mlflow", "llama_cpp", "tensorboard", "pandas", "datasets", "ray")


def _loaded(code: str, modules: tuple[str, ...]) -> list[str]:
    probe = f"import json, sys; {code}; print(json.dumps(sorted(m for m in {modules!r} if m in sys.modules)))"
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_cli_module_imports_no_ml_library_or_prefect():
    heavy = ("torch", "transformers", "peft", "bitsandbytes", "prefect", *_FOREIGN)
    assert _loaded("import slimtune.cli.main", heavy) == []


def test_flow_imports_no_plotting_tracker_llama_cpp_or_ray():
    assert _loaded("import slimtune.flows.finetune", _FOREIGN) == []


def test_flow_imports_no_trainer_peft_or_bitsandbytes():
    # transformers' Trainer modules import peft, which imports bitsandbytes: ~6 of the flow module's ~11 s of imports
    # on 2 cores, paid by every process that loads the flow (the worker's crash-hook process, a run that fails its
    # checks) before it knows whether it trains. The stage that trains imports them when it runs.
    trainer = ("transformers.trainer", "transformers.trainer_utils", "peft", "bitsandbytes")
    assert _loaded("import slimtune.flows.finetune", trainer) == []
