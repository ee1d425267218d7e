"""Benchmark reports: ratios against the HF + peft baseline and the markdown tables, from result dicts.

Used by runner.py (OUT/bench.md) and render_readme_table.py (docs/performance.md's generated section), so the
committed table and the run's own table can never disagree in layout or rounding.
"""

from __future__ import annotations

import statistics
from typing import Any

from benchmarks.common import CONFIGS, MODEL_SHAPES

_STEP_KEYS = ("step_s_min", "step_s_median", "step_s_max")
BASELINE = "hf_gc"  # HF transformers + peft + bitsandbytes with standard checkpointing


def _ratio(row: dict, base: dict, key: str) -> float | None:
    if row["status"] != "ok" or base["status"] != "ok" or not row.get(key) or not base.get(key):
        return None
    return round(row[key] / base[key], 3)


_PEAK_KEYS = ("peak_allocated_gib", "peak_reserved_gib", "host_rss_peak_gib")


def combine_rounds(rows: list[dict]) -> list[dict]:
    """One row per (model, config, batch, seq) from the rows of every round (`runner.py --rounds`).

    The device's 16 virtual cores differ in speed, and which are slow changes (core_speed.py): a host-bound
    step (1B, batch 1) took 0.16 s in one process and 0.25 s in another (benchmarks/README.md), so a single
    process per config mixes that noise into every ratio. With rounds, each config runs once per round,
    rounds alternating the order. The row keeps the median tokens/s over rounds (each round's in
    `tokens_per_s_rounds`), the fastest and slowest step of any round, and the highest memory peaks. A round
    that failed makes the row that failure: a config is only as good as its worst round. A round the time
    budget never let run ("timeout") is left out where another round measured the config.
    """
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        groups.setdefault((r["model"], r["config"], r["batch"], r["seq"]), []).append(r)
    out = []
    for group in groups.values():
        group = [r for r in group if r["status"] != "timeout"] or group
        if len(group) == 1:
            out.append(group[0])
            continue
        failed = [r for r in group if r["status"] != "ok"]
        if failed:
            out.append({**failed[0], "rounds": len(group)})
            continue
        speeds = [r["tokens_per_s"] for r in group]
        row = {**group[0], "rounds": len(group), "tokens_per_s_rounds": speeds}
        row["tokens_per_s"] = round(statistics.median(speeds), 1)
        for key, pick in (
            ("step_s_min", min),
            ("tokens_per_s_min", min),
            ("step_s_max", max),
            ("tokens_per_s_max", max),
        ):
            if all(r.get(key) is not None for r in group):
                row[key] = pick(r[key] for r in group)
        if all(r.get("step_s_median") is not None for r in group):
            row["step_s_median"] = round(statistics.median(r["step_s_median"] for r in group), 4)
        for key in _PEAK_KEYS:
            if all(r.get(key) is not None for r in group):
                row[key] = max(r[key] for r in group)
        out.append(row)
    return out


def compute_ratios(rows: list[dict]) -> list[dict]:
    """Every config against hf_gc on the same model, batch and seq: tokens/s and peak-memory ratios.

    A ratio is None unless both rows are ok, so a failed run can never show up as a speed-up.
    """
    baselines = {(r["model"], r["batch"], r["seq"]): r for r in rows if r["config"] == BASELINE}
    out = []
    for r in rows:
        b = baselines.get((r["model"], r["batch"], r["seq"]))
        if r["config"] == BASELINE or b is None:
            continue
        out.append(
            {
                "model": r["model"],
                "config": r["config"],
                "batch": r["batch"],
                "seq": r["seq"],
                "tokens_per_s_ratio": _ratio(r, b, "tokens_per_s"),
                "peak_allocated_ratio": _ratio(r, b, "peak_allocated_gib"),
                "peak_reserved_ratio": _ratio(r, b, "peak_reserved_gib"),
            }
        )
    return out


def _cell(v: Any) -> str:
    if v is None:
        return "–"
    if isinstance(v, float):
        return f"{v:.0f}" if abs(v) >= 1000 else f"{v:.3g}" if abs(v) < 1 else f"{v:.2f}"
    return str(v).replace("|", "\\|").replace("\n", " ")


def _times(v: float | None) -> str:
    return "–" if v is None else f"{v:.2f}×"


def sort_rows(rows: list[dict]) -> list[dict]:
    """Model order of MODEL_SHAPES, then batch, then config order of CONFIGS (baseline first)."""
    models, configs = list(MODEL_SHAPES), list(CONFIGS)

    def key(r: dict) -> tuple:
        return (
            models.index(r["model"]) if r["model"] in models else len(models),
            r["batch"],
            r["seq"],
            configs.index(r["config"]) if r["config"] in configs else len(configs),
        )

    return sorted(rows, key=key)


def headline(rows: list[dict]) -> list[str]:
    """The product against Unsloth and the baseline, one line per (model, batch, seq) that has a product row.

    tokens/s and peak allocated GiB per config; the ratio columns divide the product by Unsloth and by the
    hand loop ("ours", a diagnostic). Product tokens/s counts real tokens only (padding excluded).
    """
    ok = {(r["model"], r["batch"], r["seq"], r["config"]): r for r in rows if r["status"] == "ok"}
    cells = sorted({(r["model"], r["batch"], r["seq"]) for r in rows if r["config"] == "product"})
    if not cells:
        return []
    names = {k: s.name for k, s in MODEL_SHAPES.items()}

    def fig(cell: tuple, config: str) -> str:
        r = ok.get((*cell, config))
        return "–" if r is None else f"{_cell(r.get('tokens_per_s'))} / {_cell(r.get('peak_allocated_gib'))}"

    def rel(cell: tuple, config: str) -> str:
        a, b = ok.get((*cell, "product")), ok.get((*cell, config))
        if a is None or b is None:
            return "–"
        mem = _ratio(a, b, "peak_allocated_gib")
        return f"{_times(_ratio(a, b, 'tokens_per_s'))} / {_times(mem)}"

    lines = [
        "| model | batch | seq | hf_gc | unsloth | **product** | ours (hand loop) | product ÷ unsloth "
        "| product ÷ ours |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for m, b, s in sorted(cells, key=lambda c: (list(MODEL_SHAPES).index(c[0]), c[1], c[2])):
        cell = (m, b, s)
        lines.append(
            f"| {names.get(m, m)} | {b} | {s} | {fig(cell, 'hf_gc')} | {fig(cell, 'unsloth')} | "
            f"**{fig(cell, 'product')}** | {fig(cell, 'ours')} | {rel(cell, 'unsloth')} | {rel(cell, 'ours')} |"
        )
    return lines


def render_markdown(result: dict) -> str:
    """The headline, the training table (one row per model x batch x config), ratios, and merge/GGUF rows."""
    names = {k: s.name for k, s in MODEL_SHAPES.items()}
    top = headline(result["rows"])
    if top:
        top = [
            "tokens/s / peak allocated GiB; `product` is slimtune's attach_lora + packed_sft (Trainer, packing, "
            "collator, callbacks), the others the harness's fixed-batch loop:",
            "",
            *top,
            "",
        ]
    lines = top + [
        "| model | batch | seq | config | tokens/s | step s min / median / max | peak alloc GiB | "
        "peak reserved GiB | host RSS peak GiB | loss first → last | status |",
        "|---|---:|---:|---|---:|---|---:|---:|---:|---|---|",
    ]
    for r in sort_rows(result["rows"]):
        ok = r["status"] == "ok"
        steps = " / ".join(_cell(r.get(k)) for k in _STEP_KEYS) if ok else "–"
        loss = f"{_cell(r.get('loss_first'))} → {_cell(r.get('loss_last'))}" if r.get("loss_first") else "–"
        status = "ok" if ok else f"{r['status']}: {_cell(r.get('error'))[:120]}"
        lines.append(
            f"| {names.get(r['model'], r['model'])} | {r['batch']} | {r['seq']} | {r['config']} | "
            f"{_cell(r.get('tokens_per_s'))} | {steps} | {_cell(r.get('peak_allocated_gib'))} | "
            f"{_cell(r.get('peak_reserved_gib'))} | {_cell(r.get('host_rss_peak_gib'))} | {loss} | "
            f"{status} |"
        )
    lines += _rounds_lines(result["rows"], names)
    lines += _ratio_table(compute_ratios(result["rows"]), names)
    export = result.get("export") or []
    if export:
        lines += [
            "",
            "| step | model | seconds | peak GPU alloc GiB | host RSS peak GiB | bytes written | status |",
            "|---|---|---:|---:|---:|---:|---|",
        ]
        for e in export:
            status = e["status"] if e["status"] == "ok" else f"{e['status']}: {_cell(e.get('error'))[:120]}"
            written = f"{e['bytes_written']:,}" if e.get("bytes_written") else "–"
            lines.append(
                f"| {e['step']} | {names.get(e.get('model'), e.get('model'))} | "
                f"{_cell(e.get('seconds'))} | {_cell(e.get('peak_gpu_allocated_gib'))} | "
                f"{_cell(e.get('host_rss_peak_gib'))} | {written} | {status} |"
            )
    return "\n".join(lines) + "\n"


def _rounds_lines(rows: list[dict], names: dict[str, str]) -> list[str]:
    """Each round's tokens/s per row, where rows combine rounds: the spread the medians above hide."""
    multi = [r for r in sort_rows(rows) if len(r.get("tokens_per_s_rounds") or ()) > 1]
    if not multi:
        return []
    lines = ["", "tokens/s of each round (the table gives their median; rounds alternate the config order):", ""]
    for r in multi:
        each = ", ".join(_cell(float(v)) for v in r["tokens_per_s_rounds"])
        lines.append(
            f"- {names.get(r['model'], r['model'])}, batch {r['batch']}, seq {r['seq']}, {r['config']}: {each}"
        )
    return lines


def _ratio_table(ratios: list[dict], names: dict[str, str]) -> list[str]:
    """One line per (model, batch, seq), one column per config: tokens/s ratio / peak-allocated ratio."""
    if not ratios:
        return []
    configs = [c for c in CONFIGS if any(q["config"] == c for q in ratios)]
    cells: dict[tuple, dict[str, str]] = {}
    for q in ratios:
        cell = f"{_times(q['tokens_per_s_ratio'])} / {_times(q['peak_allocated_ratio'])}"
        cells.setdefault((q["model"], q["batch"], q["seq"]), {})[q["config"]] = cell
    keys = [
        (r["model"], r["batch"], r["seq"])
        for r in sort_rows([{"model": m, "batch": b, "seq": s, "config": BASELINE} for m, b, s in cells])
    ]
    lines = [
        "",
        f"Against `{BASELINE}` (HF + peft + bitsandbytes, standard checkpointing) on the same model "
        "and batch: tokens/s ratio / peak-allocated ratio (above 1× is faster; below 1× is less memory; "
        "– where either row failed):",
        "",
        "| model | batch | seq | " + " | ".join(configs) + " |",
        "|---|---:|---:|" + "---:|" * len(configs),
    ]
    for m, b, s in keys:
        row = cells[(m, b, s)]
        lines.append(f"| {names.get(m, m)} | {b} | {s} | {' | '.join(row.get(c, '–') for c in configs)} |")
    return lines
