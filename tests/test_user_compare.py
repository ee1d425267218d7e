"""benchmarks/user_compare.py's harness on the CPU, without TRL or Unsloth: the process runner's RSS and timeout,
the per-step rates of the TRL rows, the slimtune spec, the table. The tools themselves run on the GPU."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks import user_compare
from benchmarks.common import run_process
from benchmarks.trl_sft import CountingCollator, step_report


def test_run_process_reports_the_child_peak_rss(tmp_path: Path) -> None:
    """A child that holds 300 MiB: the peak (wait4's ru_maxrss) covers it, whatever this process holds."""
    code = "b = bytearray(300 * 2**20); b[::4096] = b'x' * len(b[::4096]); print('held')"
    proc = run_process([sys.executable, "-c", code], 60, tmp_path / "log")
    assert proc["rc"] == 0
    assert proc["host_rss_peak"] >= 300 * 2**20
    assert "held" in proc["tail"]


def test_run_process_kills_the_group_at_the_timeout(tmp_path: Path) -> None:
    """A child that starts a grandchild and hangs: rc None after the timeout, and the grandchild is gone too."""
    pid_file = tmp_path / "grandchild.pid"
    code = (
        "import subprocess, sys, time\n"
        "p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)'])\n"
        f"open({str(pid_file)!r}, 'w').write(str(p.pid))\n"
        "print('started', flush=True)\n"
        "time.sleep(120)\n"
    )
    proc = run_process([sys.executable, "-c", code], 3, tmp_path / "log")
    assert proc["rc"] is None
    assert proc["wall_s"] < 60
    assert "started" in proc["tail"]
    status = Path(f"/proc/{int(pid_file.read_text())}/status")
    for _ in range(100):  # SIGKILL lands when the process is next scheduled; then a zombie until init reaps it
        if not status.exists() or "State:\tZ" in status.read_text():
            break
        time.sleep(0.1)
    else:
        raise AssertionError(f"the grandchild survived the timeout: {status.read_text()}")


def test_step_report_rates_per_step_and_falls_back_to_trl_counts() -> None:
    history = [
        {"loss": 7.0, "step": 1, "num_tokens": 100.0},
        {"loss": 6.5, "step": 2, "num_tokens": 300.0},
        {"loss": 6.0, "step": 3, "num_tokens": 600.0},
        {"train_runtime": 1.0, "step": 3},
    ]
    counted = step_report(history, [1.0, 2.0, 0.5], [100, 200, 300], [128, 256, 300], 3, train_s=4.0)
    assert [e["tokens_per_s"] for e in counted["losses"]] == [100.0, 100.0, 600.0]
    assert counted["tokens"] == 600 and counted["tokens_per_s"] == 150.0
    assert counted["padding_waste"] == pytest.approx(1 - 600 / 684)
    # A trainer that replaced the collator: the counts come from TRL's cumulative num_tokens.
    logged = step_report(history, [1.0, 2.0, 0.5], [], [], 3, train_s=4.0)
    assert [e["tokens_per_s"] for e in logged["losses"]] == [100.0, 100.0, 600.0]
    assert logged["padding_waste"] == 0.0
    # No per-step clock: losses stay, rates are unknown rather than invented.
    untimed = step_report(history, [], [100, 200, 300], [100, 200, 300], 3, train_s=4.0)
    assert [e["tokens_per_s"] for e in untimed["losses"]] == [None, None, None]


def test_a_trl_report_gives_its_steady_rate_through_the_products_definition() -> None:
    """user_compare reads a TRL worker's report with product.py's report_stats, which reads train-report fields: a
    field that only the product's report has broke every TRL row on the GPU."""
    history = [{"loss": 7.0 - step / 2, "step": step} for step in (1, 2, 3)]
    report = step_report(history, [1.0, 2.0, 0.5], [100, 200, 300], [100, 200, 300], 3, train_s=4.0)
    report["batching"] = "packed, DataCollatorWithFlattening"
    row: dict = {}
    user_compare._steady(row, SimpleNamespace(**report), warmup=1)
    assert "steady_error" not in row
    assert row["steady_tokens_per_s"] == 350.0  # the median of steps 2 and 3: 100 and 600 tokens/s
    assert row["loss_first"] == 6.5 and row["loss_last"] == 5.5 and row["cuda_graphs"] is None


def test_counting_collator_counts_real_tokens_and_passes_settings_through() -> None:
    import torch

    class Padded:
        padding_free = False

        def __call__(self, features):
            ids = torch.zeros(len(features), 8, dtype=torch.long)
            mask = torch.zeros_like(ids)
            for i, n in enumerate(features):
                mask[i, :n] = 1
            return {"input_ids": ids, "attention_mask": mask}

    counter = CountingCollator(Padded())
    counter([3, 8])
    counter([5])
    assert counter.tokens == [11, 5] and counter.slots == [16, 8]
    assert counter.padding_free is False


def test_slimtune_spec_validates_and_matches_the_trl_settings(tmp_path: Path) -> None:
    from slimtune.spec.schema import parse_spec

    args = user_compare.parse_args("--model tiny --device cpu --seq 256 --steps 3 --warmup 1".split())
    (tmp_path / "model-tiny").mkdir()  # the spec's paths must exist: what main() builds and writes
    (tmp_path / "chat.jsonl").write_text('{"messages": [{"role": "user", "content": "hi"}]}\n')
    spec = parse_spec(user_compare.slimtune_spec(args, tmp_path))
    assert spec.train.max_steps == 3 and spec.train.micro_batch_size == 4 and spec.data.max_seq_length == 256
    assert spec.train.learning_rate == user_compare.LEARNING_RATE and spec.train.optimizer == user_compare.OPTIMIZER
    assert not spec.data.completion_only_loss  # TRL trains every token of chat records by default
    assert not spec.merge.enabled and spec.export.gguf == []


def test_parse_args_names_every_bad_option(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        user_compare.parse_args(["--model", "nope", "--tools", "slimtune,axolotl", "--warmup", "5", "--steps", "5"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "--model nope" in err and "--tools slimtune,axolotl" in err and "--warmup 5" in err


def test_match_card_of_runs_that_tool_first_and_needs_slimtune(capsys: pytest.CaptureFixture[str]) -> None:
    args = user_compare.parse_args(["--tools", "slimtune,hf_trl,unsloth", "--match-card-of", "unsloth"])
    assert args.tool_list == ["unsloth", "slimtune", "hf_trl"]
    with pytest.raises(SystemExit):
        user_compare.parse_args(["--tools", "unsloth", "--match-card-of", "unsloth"])
    assert "--match-card-of unsloth: needs it and slimtune in --tools" in capsys.readouterr().err


def test_render_has_a_line_per_tool_with_its_status() -> None:
    rows = [
        {"config": "slimtune", "status": "ok", "wall_s": 61.2, "train_s": 9.81, "tokens": 158_000,
         "tokens_per_s": 16106.0, "steady_tokens_per_s": 17350.5, "peak_allocated_gib": 2.1,
         "process_peak_allocated_gib": 2.4, "peak_reserved_gib": 2.5, "process_peak_reserved_gib": 2.9,
         "host_rss_peak_gib": 3.2, "loss_first": 11.76, "loss_last": 11.2},
        {"config": "unsloth", "status": "error", "error": "RuntimeError: a | b\nsecond line"},
        {"config": "hf_trl", "status": "not installed", "error": "no module ['trl']"},
    ]  # fmt: skip
    settings = {"model": "1b", "batch": 4, "seq": 2048, "steps": 20, "warmup": 3, "lora_r": 16}
    text = user_compare.render({"settings": settings, "rows": rows, "command": "python3 x --out $OUT"})
    table = [line for line in text.splitlines() if line.startswith("| ")][1:]
    assert [line.split(" | ")[0] for line in table] == ["| slimtune", "| unsloth", "| hf_trl"]
    assert all(line.count("|") == table[0].count("|") for line in table)  # the error's pipe is escaped
    assert "16,106" in table[0] and "2.1 (2.4)" in table[0] and "11.76 → 11.2" in table[0]
    assert "error: RuntimeError: a / b second line" in table[1]
    assert "Llama-3.2-1B" in text and "LoRA r=16" in text and "python3 x --out $OUT" in text
    assert "bf16-expert reference" not in text  # no such row, no such line


def test_loss_gap_against_the_bf16_expert_reference_is_the_worst_step() -> None:
    def row(tool: str, losses: list[float], status: str = "ok") -> dict:
        return {"config": tool, "status": status, "losses": [{"step": i + 1, "loss": x} for i, x in enumerate(losses)]}

    ours, ref = row("slimtune", [12.0, 11.0, 10.5]), row("bf16_experts", [12.0, 10.8, 10.5])
    gap = user_compare.loss_gap([ours, ref])
    assert gap == {"steps": 3, "max_relative": round(0.2 / 10.8, 5), "at_step": 2, "tolerance": 0.01, "within": False}
    assert user_compare.loss_gap([ours, row("bf16_experts", [12.0, 10.95, 10.5])])["within"]
    assert user_compare.loss_gap([ours, row("bf16_experts", [12.0], "error")]) is None  # nothing to compare
    settings = {"model": "gpt_oss_20b", "batch": 1, "seq": 1024, "steps": 3, "warmup": 1, "lora_r": 8}
    text = user_compare.render({"settings": settings, "rows": [ours, ref], "command": "c", "loss_vs_bf16_experts": gap})
    assert "at most 1.85% apart (step 2; tolerance 1%)" in text and "NF4 (Unsloth: experts in 16 bits)" in text


def test_the_bf16_expert_reference_is_only_for_a_mixture_of_experts(capsys: pytest.CaptureFixture[str]) -> None:
    assert user_compare.parse_args(["--model", "tiny_qwen3_moe", "--tools", "slimtune,bf16_experts"]).lora_r == 16
    with pytest.raises(SystemExit):
        user_compare.parse_args(["--model", "1b", "--tools", "slimtune,bf16_experts"])
    assert "--tools bf16_experts: only for a mixture of experts, not --model 1b" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("steps", "losses", "error"),
    [
        (20, [11.7, 11.5], None),
        (19, [11.7, 11.5], "trained 19 optimizer steps, not 20"),
        (20, [11.7, float("nan")], "non-finite"),
    ],
)
def test_a_row_is_ok_only_with_every_step_and_a_finite_loss(steps: int, losses: list[float], error: str | None) -> None:
    row = {"status": "ok", "steps": steps, "losses": [{"step": i + 1, "loss": x} for i, x in enumerate(losses)]}
    row = user_compare._check_steps(row, 20)
    assert row["status"] == ("ok" if error is None else "error")
    assert error is None or error in row["error"]


def test_set_passes_spec_fields_through_to_slimtune_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`--set` reaches `slimtune run` as its own `--set`s, in order, and is kept in the result's settings."""
    argv = "--model tiny --device cpu --set train.cuda_graphs=false --set train.micro_batch_size=2".split()
    args = user_compare.parse_args(argv)
    (tmp_path / "model-tiny").mkdir()
    (tmp_path / "chat.jsonl").write_text('{"messages": [{"role": "user", "content": "hi"}]}\n')
    commands = []

    def run_process(cmd, timeout, log):
        commands.append(cmd)
        return {"rc": 2, "wall_s": 0.1, "host_rss_peak": 0, "card_peak": None, "tail": "slimtune: error: stopped here"}

    monkeypatch.setattr(user_compare, "run_process", run_process)
    row = user_compare.slimtune_row(args, tmp_path, tmp_path, 10.0)
    assert commands[0][-4:] == ["--set", "train.cuda_graphs=false", "--set", "train.micro_batch_size=2"]
    assert row["status"] == "error" and "set" in user_compare._SETTINGS


def test_the_slimtune_row_reads_its_choices_from_the_train_report_slimtune_writes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What `auto` chose (micro-batch, graphs, stored layers) and the steady rate come from the run's own
    train_report.json, in the fields slimtune's TrainReport writes: the headline table shows them."""
    from dataclasses import asdict

    from slimtune.train.result import TrainReport

    args = user_compare.parse_args("--model tiny --device cpu --steps 4 --warmup 1".split())
    (tmp_path / "model-tiny").mkdir()
    (tmp_path / "chat.jsonl").write_text('{"messages": [{"role": "user", "content": "hi"}]}\n')
    losses = [{"step": s, "loss": 3.0 - s / 10, "tokens_per_s": 100.0 * s} for s in range(1, 5)]
    report = TrainReport(
        steps=4, losses=losses, eval_loss_before=None, eval_loss_after=None, tokens_seen=4096, tokens_per_s=250.0,
        padding_waste=0.0, packing_efficiency=1.0, batching="packed", batching_fallback=None, resumed_from=None,
        not_resumed=None, seconds=9.0, training_seconds=8.0, micro_batch_size=2, gradient_accumulation_steps=2,
        optimizer="adamw_torch", precision="fp32", adapter_dir="a", cuda_graphs="28 captured, 90 replays",
        stored_layers=2,
    )  # fmt: skip
    spec_name = user_compare.slimtune_spec(args, tmp_path)["name"]

    def run_process(cmd, timeout, log):
        run_dir = tmp_path / "runs" / spec_name
        run_dir.mkdir(parents=True)
        (run_dir / "train_report.json").write_text(json.dumps(asdict(report)))
        return {"rc": 0, "wall_s": 10.0, "host_rss_peak": 0, "card_peak": None, "tail": ""}

    monkeypatch.setattr(user_compare, "run_process", run_process)
    row = user_compare.slimtune_row(args, tmp_path, tmp_path, 10.0)
    assert row["micro_batch_x_accumulation"] == "2 x 2" and row["stored_layers"] == 2
    assert row["cuda_graphs"] == "28 captured, 90 replays" and row["steady_tokens_per_s"] == 300.0  # steps 2-4
    assert row["status"] == "ok", row
