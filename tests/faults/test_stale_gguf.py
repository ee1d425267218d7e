"""A re-run with another `export.gguf` list: `generate`/`chat` never load a GGUF the run's spec does not produce.

Seen before: a re-run with a changed spec and export list left the previous run's GGUF files in `gguf/`, and
`slimtune generate`/`chat` loaded the stale one by default (it was the most precise type there). Now they
are also moved to `gguf.previous/`, so `gguf/` (and a push of it) holds one run's files.
"""

from __future__ import annotations

import shutil

import pytest
import yaml
from faultlib import BASE_SPEC, leftovers, run_finetune, spec_dict


@pytest.mark.fault(
    "Re-run with a changed export.gguf list",
    stage="generate",
    expect="the default GGUF and --gguf choose only files of this run's export.gguf; a stale one is named as such",
)
def test_generate_ignores_gguf_files_of_an_earlier_run(tmp_path, observe):
    from slimtune.inference.generate import RunDirError, pick_gguf

    run_dir = tmp_path / "faults"
    (run_dir / "gguf").mkdir(parents=True)
    data = spec_dict(tmp_path, export={"gguf": ["q8_0"], "verify": False})
    (run_dir / "spec.effective.yaml").write_text(yaml.safe_dump(data))
    # the earlier run exported f16 (more precise, so the old default) and a split f32; this one q8_0
    for name in ("faults-f16.gguf", "faults-f32-00001-of-00002.gguf", "faults-f32-00002-of-00002.gguf"):
        (run_dir / "gguf" / name).write_bytes(b"")
    (run_dir / "gguf" / "faults-q8_0.gguf").write_bytes(b"")
    assert pick_gguf(run_dir).name == "faults-q8_0.gguf"
    with pytest.raises(RunDirError, match="faults-f16.gguf is left from an earlier run") as err:
        pick_gguf(run_dir, "f16")
    observe(str(err.value).replace(str(tmp_path), "…"))

    data["export"]["gguf"] = ["f32"]  # split files of the run's own type are its files
    (run_dir / "spec.effective.yaml").write_text(yaml.safe_dump(data))
    assert pick_gguf(run_dir).name == "faults-f32-00001-of-00002.gguf"


@pytest.mark.fault(
    "Re-run with a changed export.gguf list",
    stage="gguf_convert_and_push",
    expect="the GGUF files the new list no longer produces are moved to gguf.previous/; gguf/ holds this run's only",
)
def test_rerun_with_another_export_list_moves_the_old_gguf_aside(reference_run, tmp_path, prefect_harness, observe):
    from slimtune.inference.generate import pick_gguf

    run_dir = tmp_path / "faults"
    # The first run is the session's reference run, whose spec exports one f16 GGUF unverified: its run directory,
    # copied, rather than a second training of the same spec (~20 s on 2 loaded cores)
    assert BASE_SPEC["export"] == {"gguf": ["f16"], "verify": False}
    shutil.copytree(reference_run["run_dir"], run_dir)
    first = sorted(p.name for p in (run_dir / "gguf").glob("*.gguf"))
    run_finetune(spec_dict(tmp_path, export={"gguf": ["q8_0"], "verify": False}))
    now = sorted(p.name for p in (run_dir / "gguf").glob("*.gguf"))
    aside = sorted(p.name for p in (run_dir / "gguf.previous").glob("*"))
    observe(f"gguf/ {first} -> {now}; gguf.previous/ {aside}")
    assert first == ["faults-f16.gguf"]
    assert now == ["faults-q8_0.gguf"]
    assert aside == ["faults-f16.gguf"]
    assert pick_gguf(run_dir).name == "faults-q8_0.gguf"
    assert not leftovers(run_dir)
