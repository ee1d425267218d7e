"""The run report: one JSON file for machines, one markdown file and Prefect artifact for people."""

from __future__ import annotations

import logging
from pathlib import Path

from slimtune import atomic

log = logging.getLogger(__name__)


def _fmt(value) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    if isinstance(value, (list, tuple)) and len(value) > 6:
        return f"{len(value)} items"
    return str(value)


def _rows(title: str, record: dict) -> list[str]:
    rows = [f"### {title}", "", "| field | value |", "|---|---|"]
    for key, value in record.items():
        if isinstance(value, dict):
            continue
        rows.append(f"| {key} | {_fmt(value)} |")
    return rows + [""]


def render_markdown(summary: dict) -> str:
    """A readable report: one table per stage, in pipeline order (nested records are left to the JSON)."""
    spec = summary.get("spec", {})
    lines = [
        f"# slimtune run `{spec.get('name', '?')}`",
        "",
        f"Model `{spec.get('model', {}).get('name_or_path', '?')}`, data `{spec.get('data', {}).get('path', '?')}`.",
        "",
    ]
    for stage in ("load_4bit", "attach_lora", "packed_sft", "cleanup", "dequant_merge", "gguf_convert_and_push"):
        if isinstance(summary.get(stage), dict):
            lines += _rows(stage, summary[stage])
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
