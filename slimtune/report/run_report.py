"""Every markdown report of a run, rendered here: the run report and the memory report.

The run report is one JSON file for machines, one markdown file and Prefect artifact for people. Its
markdown leads with what a user takes away (the GGUF files and how well llama.cpp reproduces the merged
model, where the adapter and merged model are, eval loss before and after, time and memory per stage);
the per-stage details follow. The memory report (a Prefect artifact, published by
`slimtune.report.memory_report`) is the guard's estimate, budget, peaks and downshifts of every stage.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING

from slimtune.core import atomic
from slimtune.spec.schema import STAGES

if TYPE_CHECKING:
    from slimtune.memory.guard import GuardRecord

log = logging.getLogger(__name__)
_GIB = 1024**3
# Stage table columns: (header, GuardRecord field, format); a column that is empty in every row is left out
# (on a CPU run every GPU figure is None).
_STAGE_COLUMNS = (
    ("seconds", "seconds", lambda v: f"{v:.1f}"),
    ("peak host RSS GiB", "peak_host_rss", lambda v: f"{v / _GIB:.2f}"),
    ("peak GPU allocated GiB", "peak_gpu_allocated", lambda v: f"{v / _GIB:.2f}"),
    ("peak GPU used GiB", "peak_device_used", lambda v: f"{v / _GIB:.2f}"),
    ("attempts", "attempts", lambda v: str(v) if v > 1 else None),
    ("downshifts", "downshifts", lambda v: "; ".join(v) or None),
)


def _fmt(value) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def _size(n: int) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n} B"


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    return ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)] + ["| " + " | ".join(r) + " |" for r in rows]


def _training_rows(trained: dict) -> list[list[str]]:
    rows = []
    if trained.get("reused_from"):
        rows.append(["trained", f"nothing left to train: results of run {trained['reused_from']}"])
    before, after = trained.get("eval_loss_before"), trained.get("eval_loss_after")
    if before is not None or after is not None:
        rows.append(["eval loss", f"{_fmt(before)} → {_fmt(after)}"])
    losses = trained.get("losses") or []
    if losses:
        rows.append(["train loss", f"{losses[0]['loss']:.4g} → {losses[-1]['loss']:.4g} (step {losses[-1]['step']})"])
    rows.append(["steps", str(trained.get("steps"))])
    if trained.get("training_seconds") is not None:  # the run's, kept by a re-run; `seconds` is this call's
        rows.append(["training time", f"{trained['training_seconds']:.1f} s"])
    rows.append(["tokens/s", f"{trained.get('tokens_per_s', 0):,.0f} ({trained.get('tokens_seen', 0):,} tokens)"])
    rows.append(["padding waste", f"{100 * trained.get('padding_waste', 0):.1f}%"])
    rows.append(["adapter", f"`{trained.get('adapter_dir')}`"])
    return rows


def _gguf_rows(export: dict) -> list[list[str]]:
    rows = []
    for name, size in export.get("files", {}).items():
        check = export.get("verification", {}).get(name, {})
        if "argmax_agreement" in check:
            verified = [
                f"{100 * check['argmax_agreement']:.1f}%",
                f"{check['max_abs_logit_diff']:.3g}",
                "yes" if check.get("token_ids_equal") else f"no (prompts {check.get('token_mismatches')})",
            ]
        else:
            verified = [check.get("skipped", "not verified"), "", ""]
        rows.append([f"`{name}`", _size(size), *verified])
    return rows


def _stage_rows(memory: list[dict]) -> tuple[list[str], list[list[str]]]:
    columns = [c for c in _STAGE_COLUMNS if any(r.get(c[1]) not in (None, [], 0) and c[2](r[c[1]]) for r in memory)]
    rows = []
    for r in memory:
        cells = [c[2](r[c[1]]) if r.get(c[1]) not in (None, []) else "" for c in columns]
        rows.append([r["stage"], r.get("outcome", "?"), *[cell or "" for cell in cells]])
    return ["stage", "outcome", *[c[0] for c in columns]], rows


def render_results(summary: dict) -> list[str]:
    """The results section: training outcome, GGUF files and their verification, paths, time and memory."""
    lines = ["## Results", ""]
    trained = summary.get("packed_sft")
    if isinstance(trained, dict):
        lines += _table(["training", ""], _training_rows(trained)) + [""]
    merged = summary.get("dequant_merge")
    if isinstance(merged, dict) and merged.get("out_dir"):
        lines += [f"Merged model: `{merged['out_dir']}`", ""]
    export = summary.get("gguf_convert_and_push")
    if isinstance(export, dict) and export.get("files"):
        lines += ["### GGUF files, verified in llama.cpp against the merged model", ""]
        header = ["file", "size", "argmax agreement", "max logit difference", "same token ids"]
        lines += _table(header, _gguf_rows(export)) + [""]
        lines += _mmproj_lines(export.get("mmproj"))
        lines += _chat_template_lines(export.get("chat_template"))
        pushed = export.get("pushed")
        if pushed:
            lines += [f"Pushed to `{pushed.get('repo_id')}`: {pushed.get('commit_url')}", ""]
    memory = summary.get("memory") or []
    if memory:
        header, rows = _stage_rows(memory)
        lines += ["### Time and memory per stage", ""] + _table(header, rows) + [""]
    return lines


def _mmproj_lines(mmproj: dict | None) -> list[str]:
    """The vision projector GGUF and its image embeddings against transformers'."""
    if not mmproj:
        return []
    if "file" not in mmproj:
        return [f"Vision projector (`--mmproj`): not written; {mmproj.get('skipped')}.", ""]
    check = mmproj.get("verification") or {}
    if "max_abs_diff" in check:
        verified = (
            f"image embeddings in llama.cpp {check['max_abs_diff']:.3g} off transformers' "
            f"(largest {check['max_abs_embedding']:.3g}, {check['tokens']} tokens)"
        )
        if check.get("non_finite_tokens"):
            verified += f", {check['non_finite_tokens']} of them not finite in llama.cpp and left out"
    else:
        verified = check.get("skipped", "not verified")
    return [f"Vision projector (`--mmproj`): `{mmproj['file']}`, {_size(mmproj['bytes'])}; {verified}.", ""]


def _chat_template_lines(outcome: dict | None) -> list[str]:
    """The Modelfile's chat template: the format of its TEMPLATE, or that it has none, why and how to chat."""
    if not outcome:
        return []
    if outcome.get("format") != "none":
        return [f"Modelfile TEMPLATE: {outcome.get('format')} chat format.", ""]
    lines = [f"Modelfile TEMPLATE: none; {outcome.get('reason')}."]
    if outcome.get("run_with"):
        lines.append(f"Chat with it through: {outcome['run_with']}.")
    return lines + [""]


def _details(title: str, record: dict) -> list[str]:
    rows = [[key, _fmt(value)] for key, value in record.items() if not isinstance(value, (dict, list))]
    return [f"### {title}", ""] + _table(["field", "value"], rows) + [""]


def render_markdown(summary: dict) -> str:
    """The report: results first, then one table per stage (lists and nested records stay in the JSON)."""
    spec = summary.get("spec", {})
    data = str(spec.get("data", {}).get("path", "?"))
    lines = [
        f"# slimtune run `{spec.get('name', '?')}`",
        "",
        f"Model `{spec.get('model', {}).get('name_or_path', '?')}`, data `{Path(data).name or data}`.",
        "",
        *render_results(summary),
        "## Stage details",
        "",
    ]
    for stage in STAGES:
        if isinstance(summary.get(stage), dict):
            lines += _details(stage, summary[stage])
    lines += _data_sources(((summary.get("packed_sft") or {}).get("data") or {}).get("sources") or [])
    lines += _evaluation(summary.get("evaluation") or {})
    return "\n".join(lines)


def _data_sources(sources: list[dict]) -> list[str]:
    """One row per file of a data.sources mix: what it gave before and after weighting."""
    if not sources:
        return []
    keys = ["path", "weight", "format", "records", "train_examples", "train_examples_used", "eval_examples"]
    lines = ["### data sources", "", "| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
    lines += ["| " + " | ".join(_fmt(src.get(k)) for k in keys) + " |" for src in sources]
    return lines + [""]


def _cell(text: str) -> str:
    """Text that stays inside one markdown table cell."""
    return text.replace("|", "\\|").replace("\n", "<br>") or "(empty)"


def _evaluation(evaluation: dict) -> list[str]:
    """Held-out loss and perplexity before/after training, and base vs fine-tuned answers (eval.prompts)."""
    if not evaluation:
        return []
    lines = ["### evaluation", "", "| held-out split | base (before) | fine-tuned (after) |", "|---|---|---|"]
    for key in ("eval_loss", "perplexity"):
        lines.append(f"| {key} | {_fmt(evaluation.get(f'{key}_before'))} | {_fmt(evaluation.get(f'{key}_after'))} |")
    lines.append("")
    if evaluation.get("prompts"):
        lines += ["| prompt | base | fine-tuned |", "|---|---|---|"]
        lines += [
            f"| {_cell(r['prompt'])} | {_cell(r['base'])} | {_cell(r['fine_tuned'])} |" for r in evaluation["prompts"]
        ]
        lines.append("")
    return lines


def _gib(value: int | None) -> str:
    return "n/a" if value is None else f"{value / _GIB:.2f}"


def memory_row(record: GuardRecord) -> dict[str, str | int]:
    """One memory report row (also the per-attempt table artifact); sizes in GiB."""
    est = record.estimate
    return {
        "stage": record.stage,
        "outcome": record.outcome,
        "attempts": record.attempts,
        "estimate GPU GiB": _gib(est.gpu_bytes if est else None),
        "estimate host GiB": _gib(est.host_bytes if est else None),
        "budget GiB": _gib(record.budget),
        "peak GPU allocated GiB": _gib(record.peak_gpu_allocated),
        "peak GPU reserved GiB": _gib(record.peak_gpu_reserved),
        "peak device used GiB": _gib(record.peak_device_used),
        "peak host RSS GiB": _gib(record.peak_host_rss),
        "seconds": f"{record.seconds:.1f}",
        "downshifts": "; ".join(record.downshifts) or "none",
    }


def render_memory_markdown(records: list[GuardRecord]) -> str:
    """The flow's memory report: a table of every stage, then each downshift on its own line."""
    lines = ["# Memory report", ""]
    if not records:
        return "\n".join([*lines, "No guarded stages ran."])
    rows = [memory_row(r) for r in records]
    # A column that reads n/a in every row (every GPU figure on a CPU run) only pushes the real ones off-screen.
    columns = [c for c in rows[0] if c != "downshifts" and any(row[c] != "n/a" for row in rows)]
    lines += _table(columns, [[str(row[c]) for c in columns] for row in rows])
    shifts = [(r.stage, note) for r in records for note in r.downshifts]
    lines += ["", "## Downshifts", ""]
    lines += [f"- {stage}: {note}" for stage, note in shifts] or ["None: every stage ran as configured."]
    return "\n".join(lines)


def done_line(summary: dict) -> str:
    """The CLI's last line: what the run produced (eval loss, GGUF files) and the readable report's path."""
    report_md = Path(summary["report"]).with_name("report.md")
    trained = summary.get("packed_sft") or {}
    before, after = trained.get("eval_loss_before"), trained.get("eval_loss_after")
    parts = [f"eval loss {_fmt(before)} -> {_fmt(after)}"] if before is not None and after is not None else []
    files = (summary.get("gguf_convert_and_push") or {}).get("files") or {}
    if files:  # the export task writes them under <run dir>/gguf/
        parts.append("GGUF " + ", ".join(str(report_md.parent / "gguf" / name) for name in files))
    return "slimtune: done; " + "; ".join([*parts, f"report at {report_md}"])


def write_run_report(run_dir: Path, summary: dict) -> Path:
    """Write report.json and report.md under `run_dir` and publish the markdown as a Prefect artifact."""
    path = atomic.write_json(run_dir / "report.json", summary)
    markdown = render_markdown(summary)
    atomic.write_text(run_dir / "report.md", markdown)
    try:
        from prefect.artifacts import create_markdown_artifact
        from prefect.context import FlowRunContext

        if FlowRunContext.get() is not None:
            create_markdown_artifact(markdown, key="run-report", description="slimtune run report")
    except Exception as e:  # the report on disk is the record; the UI copy is a convenience
        log.warning("could not publish the run report artifact: %s", e)
    return path
