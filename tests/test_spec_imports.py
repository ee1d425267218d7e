"""Validating a spec is cheap: importing slimtune.spec.schema loads no torch, transformers, peft or bitsandbytes."""

from __future__ import annotations

import subprocess
import sys


def test_spec_module_imports_no_ml_library():
    code = (
        "import sys; import slimtune.spec.schema; "
        "print(sorted(m for m in ('torch', 'transformers', 'peft', 'bitsandbytes') if m in sys.modules))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "[]", done.stdout
