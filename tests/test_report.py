"""The run report leads with results: GGUF files and their verification, paths, eval loss, time and memory."""

from __future__ import annotations

from slimtune.report.run_report import done_line, render_markdown

_GIB = 1024**3


def _summary(**train) -> dict:
    return {
        "spec": {
            "name": "r1",
            "model": {"name_or_path": "builtin:tiny-llama"},
            "data": {"path": "/abs/dir/chat.jsonl"},
        },
        "packed_sft": {
            "steps": 30,
            "losses": [{"step": 1, "loss": 5.5}, {"step": 30, "loss": 2.25}],
            "eval_loss_before": 5.6,
            "eval_loss_after": 2.4,
            "tokens_seen": 12000,
            "tokens_per_s": 950.0,
            "padding_waste": 0.02,
            "adapter_dir": "/runs/r1/adapter",
            **train,
        },
        "dequant_merge": {"out_dir": "/runs/r1/merged", "reused": False},
        "gguf_convert_and_push": {
            "files": {"r1-f16.gguf": 3 * 2**20, "r1-q8_0.gguf": 2**20},
            "verification": {
                "r1-f16.gguf": {"argmax_agreement": 1.0, "max_abs_logit_diff": 0.0012, "token_ids_equal": True},
                "r1-q8_0.gguf": {"argmax_agreement": 0.975, "max_abs_logit_diff": 0.21, "token_ids_equal": True},
            },
            "pushed": None,
        },
        "memory": [
            {
                "stage": s,
                "outcome": "completed",
                "seconds": 1.5 * k,
                "peak_host_rss": k * _GIB,
                "peak_gpu_allocated": None,
                "peak_device_used": None,
                "attempts": 1,
                "downshifts": [],
            }
            for k, s in enumerate(("load_4bit", "packed_sft", "dequant_merge"), 1)
        ],
    }


def _rows(markdown: str) -> list[list[str]]:
    return [[c.strip() for c in line.strip("|").split("|")] for line in markdown.splitlines() if line.startswith("|")]


def test_results_come_first_and_hold_what_a_user_takes_away():
    md = render_markdown(_summary())
    assert md.index("## Results") < md.index("## Stage details")
    results = md[: md.index("## Stage details")]
    rows = _rows(results)
    assert ["`r1-q8_0.gguf`", "1.00 MiB", "97.5%", "0.21", "yes"] in rows
    assert ["`r1-f16.gguf`", "3.00 MiB", "100.0%", "0.0012", "yes"] in rows
    assert ["eval loss", "5.6 → 2.4"] in rows and ["tokens/s", "950 (12,000 tokens)"] in rows
    assert "`/runs/r1/merged`" in results and "`/runs/r1/adapter`" in results
    # On a CPU run every GPU figure is None: no GPU column, no n/a anywhere.
    stage_header = next(r for r in rows if r[0] == "stage")
    assert stage_header == ["stage", "outcome", "seconds", "peak host RSS GiB"], stage_header
    assert ["packed_sft", "completed", "3.0", "2.00"] in rows
    assert "n/a" not in md and "items" not in md and "/abs/dir" not in md


def test_gpu_columns_appear_when_there_are_gpu_figures():
    summary = _summary()
    summary["memory"][1].update(peak_gpu_allocated=6 * _GIB, attempts=2, downshifts=["micro-batch 4 -> 2"])
    rows = _rows(render_markdown(summary))
    header = next(r for r in rows if r[0] == "stage")
    assert header == [
        "stage",
        "outcome",
        "seconds",
        "peak host RSS GiB",
        "peak GPU allocated GiB",
        "attempts",
        "downshifts",
    ]
    assert ["packed_sft", "completed", "3.0", "2.00", "6.00", "2", "micro-batch 4 -> 2"] in rows


def test_a_reused_run_says_whose_results_it_shows():
    md = render_markdown(_summary(reused_from="0b7e-run-one"))
    assert "nothing left to train: results of run 0b7e-run-one" in md
    assert ["tokens/s", "950 (12,000 tokens)"] in _rows(md)


def test_a_reused_run_shows_the_original_training_time():
    # The re-run's call took 3.6 s and trained nothing; the run trained for 115 s (the checkpoint's time).
    md = render_markdown(_summary(reused_from="0b7e-run-one", seconds=3.6, training_seconds=115.04))
    results = _rows(md[: md.index("## Stage details")])
    assert ["training time", "115.0 s"] in results
    assert not any("3.6" in cell for row in results for cell in row), results


def test_the_last_line_of_a_run_gives_the_result_and_the_readable_report():
    summary = _summary() | {"report": "/runs/r1/report.json"}
    assert done_line(summary) == (
        "slimtune: done; eval loss 5.6 -> 2.4; GGUF /runs/r1/gguf/r1-f16.gguf, /runs/r1/gguf/r1-q8_0.gguf; "
        "report at /runs/r1/report.md"
    )
    # merge and export off: only what the run made
    bare = {"packed_sft": {"eval_loss_before": None, "eval_loss_after": None}, "report": "/runs/r1/report.json"}
    assert done_line(bare) == "slimtune: done; report at /runs/r1/report.md"
