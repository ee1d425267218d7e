"""CPU smoke test of the benchmark harness: the real runner machinery on a toy shape, no timing asserts.

It runs the HF configs (bitsandbytes NF4 works on the CPU) through `runner.main` in-process, checks the
JSON rows are complete and consistent, that absent baselines are recorded as "not installed" (never as
numbers), that ratios only exist between ok rows, and that the markdown and README section render.
"""

from __future__ import annotations

import importlib.util
import json
import math
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks import render_readme_table, runner
from benchmarks.common import MODEL_SHAPES, markers
from benchmarks.report import combine_rounds, compute_ratios, render_markdown

MEASURED = ("tokens_per_s", "step_s_min", "step_s_median", "step_s_max", "loss_first", "loss_last", "host_rss_peak_gib")


@pytest.fixture(scope="module")
def suite(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, Path]:
    out = tmp_path_factory.mktemp("bench")
    rc = runner.main(
        [
            "--device",
            "cpu",
            "--models",
            "tiny",
            "--configs",
            "hf_gc,hf_nogc,liger,unsloth",
            "--batch",
            "1,2",
            "--seq",
            "16",
            "--warmup",
            "1",
            "--steps",
            "1",
            "--out",
            str(out),
            "--scratch",
            str(out),
            "--in-process",
        ]
    )
    assert rc == 0
    return json.loads((out / "bench.json").read_text()), out


def test_rows_are_complete_and_consistent(suite: tuple[dict, Path]) -> None:
    result, _ = suite
    rows = {(r["config"], r["batch"]): r for r in result["rows"]}
    assert set(rows) == {(c, b) for c in ("hf_gc", "hf_nogc", "liger", "unsloth") for b in (1, 2)}
    for cfg in ("hf_gc", "hf_nogc"):
        for b in (1, 2):
            r = rows[(cfg, b)]
            assert r["status"] == "ok", r
            assert r["model"] == "tiny" and r["seq"] == 16 and r["steps_timed"] == 1
            assert all(isinstance(r[k], float) and r[k] > 0 for k in MEASURED), r
            assert r["step_s_min"] <= r["step_s_median"] <= r["step_s_max"]
            # tokens/s is derived from the unrounded median step; the stored median is rounded to 0.1 ms and
            # tokens/s to 0.1, so tokens/s must lie in the interval the rounded median allows
            med = r["step_s_median"]
            assert b * 16 / (med + 5e-5) - 0.05 <= r["tokens_per_s"] <= b * 16 / (med - 5e-5) + 0.05
            # a random init with std 0.02 gives near-uniform logits: the loss starts near ln(vocab) = 6.93
            # (seeded; 6.89 here, the gap is the 16-token sample, not noise between runs)
            assert abs(r["loss_first"] - math.log(MODEL_SHAPES["tiny"].config["vocab_size"])) < 0.25
            assert r["peak_allocated_gib"] is None and r["peak_reserved_gib"] is None  # no GPU, no number
    # same LoRA init (B = 0) and batch: checkpointing must not change the forward pass
    for b in (1, 2):
        assert rows[("hf_nogc", b)]["loss_first"] == pytest.approx(rows[("hf_gc", b)]["loss_first"], abs=1e-3)
    setup = [s for w in result["workers"] for s in w.get("setup", [])]
    assert setup and setup[0]["nf4_layers"] == 2 * 7  # two layers, seven projections each, lm_head kept


@pytest.mark.parametrize("config,package", [("liger", "liger_kernel"), ("unsloth", "unsloth")])
def test_absent_baselines_are_not_installed(suite: tuple[dict, Path], config: str, package: str) -> None:
    if importlib.util.find_spec(package) is not None:
        pytest.skip(f"{package} is installed here; its rows are real measurements")
    result, _ = suite
    rows = [r for r in result["rows"] if r["config"] == config]
    assert len(rows) == 2
    for r in rows:
        assert r["status"] == "not installed" and package in r["error"]
        assert r.get("tokens_per_s") is None and r.get("peak_allocated_gib") is None


def test_ratios_only_between_ok_rows(suite: tuple[dict, Path]) -> None:
    result, _ = suite
    ratios = {(q["config"], q["batch"]): q for q in result["ratios"]}
    rows = {(r["config"], r["batch"]): r for r in result["rows"]}
    for b in (1, 2):
        q = ratios[("hf_nogc", b)]
        expected = rows[("hf_nogc", b)]["tokens_per_s"] / rows[("hf_gc", b)]["tokens_per_s"]
        assert q["tokens_per_s_ratio"] == pytest.approx(expected, rel=0.01)
        assert ratios[("liger", b)]["tokens_per_s_ratio"] is None
    # a failed baseline row must void the ratios of that batch instead of producing a number
    rows_in = result["rows"]
    broken = [dict(r, status="oom") if (r["config"], r["batch"]) == ("hf_gc", 1) else r for r in rows_in]
    voided = {(q["config"], q["batch"]): q for q in compute_ratios(broken)}
    assert voided[("hf_nogc", 1)]["tokens_per_s_ratio"] is None
    assert voided[("hf_nogc", 2)]["tokens_per_s_ratio"] is not None


def test_markdown_and_readme_section_render(suite: tuple[dict, Path], tmp_path: Path) -> None:
    result, out = suite
    md = (out / "bench.md").read_text()
    assert md == render_markdown(result)
    table = [line for line in md.splitlines() if line.startswith("| tiny-llama |")]
    assert len(table) == len(result["rows"]) + 2  # one line per row, plus one ratio line per batch
    assert all(line.count("|") == table[0].count("|") for line in table[: len(result["rows"])])
    assert sum("not installed" in line for line in table) == 4

    readme = tmp_path / "README.md"
    start, end = markers("performance")
    readme.write_text(f"# x\n\n{start}\nold\n{end}\n\ntail\n")
    render_readme_table.main([str(out / "bench.json"), "--readme", str(readme)])
    text = readme.read_text()
    assert "old" not in text and text.endswith("tail\n") and "## Performance" in text
    assert "python3 benchmarks/runner.py --device cpu --models tiny" in text
    assert "| tiny-llama | 2 | 16 | hf_nogc |" in text

    readme.write_text("# no markers\n")
    with pytest.raises(ValueError, match="performance:start"):
        render_readme_table.main([str(out / "bench.json"), "--readme", str(readme)])


def test_export_hooks_time_slimtune_merge_and_gguf(tmp_path: Path) -> None:
    from benchmarks.export_steps import export_step

    recs = [export_step(step, "tiny", "cpu", tmp_path) for step in ("prep", "merge", "gguf")]
    assert [r["step"] for r in recs] == ["prep", "merge", "gguf f16"]
    for r in recs:
        assert r["status"] == "ok", r
        assert r["seconds"] >= 0 and r["host_rss_peak_gib"] > 0 and r["peak_gpu_allocated_gib"] is None
    gguf_files = list(tmp_path.glob("model-tiny-f16*.gguf"))
    assert len(gguf_files) == 1 and recs[2]["bytes_written"] == gguf_files[0].stat().st_size
    merged = tmp_path / "merged-tiny"
    assert recs[1]["bytes_written"] == sum(p.stat().st_size for p in merged.rglob("*") if p.is_file())
    assert recs[1]["report"]["tensors_merged"] == 2 * 7  # every LoRA target of both layers


def test_product_rows_come_from_the_train_report(tmp_path: Path) -> None:
    # The product config runs slimtune's attach_lora + packed_sft on the toy shape; its speed is the train
    # report's per-step tokens/s after warm-up, never a number the harness timed itself. Two rounds in one
    # scratch folder: the second must train afresh, not resume the first round's finished run.
    rc = runner.main(
        ["--device", "cpu", "--models", "tiny", "--configs", "product", "--batch", "2", "--seq", "64", "--rounds", "2"]
        + ["--warmup", "1", "--steps", "2", "--out", str(tmp_path), "--scratch", str(tmp_path), "--in-process"]
    )
    assert rc == 0
    result = json.loads((tmp_path / "bench.json").read_text())
    (row,) = result["rows"]
    assert row["status"] == "ok", row
    assert row["config"] == "product" and row["steps_timed"] == 2 and row["batching"] == "packed"
    assert row["rounds"] == 2 and len(row["tokens_per_s_rounds"]) == 2
    assert 0 < row["tokens_per_s_min"] <= row["tokens_per_s"] <= row["tokens_per_s_max"]
    assert abs(row["loss_first"] - math.log(MODEL_SHAPES["tiny"].config["vocab_size"])) < 0.5
    first, last = result["round_rows"]
    assert [first["round"], last["round"]] == [0, 1] and first["status"] == last["status"] == "ok"
    report = json.loads((tmp_path / "product-tiny" / "runs" / "product-tiny-b2" / "train_report.json").read_text())
    assert report["resumed_from"] is None and [e["step"] for e in report["losses"]] == [1, 2, 3]
    assert min(e["tokens_per_s"] for e in report["losses"][1:]) == pytest.approx(last["tokens_per_s_min"], abs=0.05)


def test_rounds_combine_to_the_median_and_the_worst_case() -> None:
    def row(config: str, tps: float, status: str = "ok", **kw: float) -> dict:
        base = {"model": "1b", "config": config, "batch": 1, "seq": 2048, "status": status, "tokens_per_s": tps}
        return base | {"step_s_min": 1.0, "step_s_median": 2.0, "step_s_max": 3.0, "peak_allocated_gib": 1.0} | kw

    rows = [
        row("ours", 100.0, step_s_min=0.5, peak_allocated_gib=1.5),
        row("ours", 300.0, step_s_max=4.0),
        row("ours", 200.0),
        row("unsloth", 100.0),
        row("unsloth", 0.0, status="oom"),
        row("hf_gc", 50.0),
        row("hf_gc", 0.0, status="timeout"),  # the budget never let round 2 run: round 1 stands
    ]
    combined = {r["config"]: r for r in combine_rounds(rows)}
    ours = combined["ours"]
    assert ours["tokens_per_s"] == 200.0 and ours["tokens_per_s_rounds"] == [100.0, 300.0, 200.0]
    assert (ours["step_s_min"], ours["step_s_max"], ours["peak_allocated_gib"]) == (0.5, 4.0, 1.5)
    assert ours["rounds"] == 3
    assert combined["unsloth"]["status"] == "oom"
    assert combined["hf_gc"]["status"] == "ok" and combined["hf_gc"]["tokens_per_s"] == 50.0
    assert "tokens/s of each round" in render_markdown({"rows": list(combined.values())})


def test_process_rss_sampler_sees_an_allocation_in_this_process() -> None:
    from benchmarks.common import ProcessRssSampler

    with ProcessRssSampler(interval_s=0.01) as rss:
        block = bytearray(300 * 1024**2)  # zero-filled pages: resident once touched
        block[::4096] = b"\x01" * len(block[::4096])
        del block
    assert rss.peak_host_rss - rss.start_host_rss > 250 * 1024**2


@pytest.mark.parametrize(
    "key,params",
    [
        ("gemma3_1b", 999_885_952),
        ("phi3_mini", 3_821_079_552),
        ("qwen3_30b_a3b", 30_532_122_624),
        ("gpt_oss_20b", 20_914_757_184),
    ],
)
def test_family_shapes_are_the_released_models(key: str, params: int) -> None:
    """The real-size shapes of benchmarks/families_bench.py: the released parameter counts (built on the meta
    device), and configs slimtune accepts and can export."""
    import torch
    from transformers import AutoModelForCausalLM

    from benchmarks.common import build_config
    from slimtune.models.families import check_architecture

    config = build_config(MODEL_SHAPES[key])
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    assert sum(p.numel() for p in model.parameters()) == params
    assert check_architecture(config.to_dict()) is None
