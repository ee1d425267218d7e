"""Command line: `slimtune run SPEC`, `slimtune validate SPEC`.

Failures end with one line, `slimtune: error: <reason>`, and a non-zero exit code, so that scripts and
schedulers can tell what went wrong without reading a traceback.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

# Prefect reads its settings at import; telemetry calls fail without internet and only add noise, and
# the embedded server's 20 s start-up limit is too short on a busy 2-core machine (seen: >20 s).
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "120")

EXIT_INVALID_SPEC = 2
EXIT_FAILED = 1


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="slimtune", description="QLoRA fine-tuning to GGUF as one Prefect flow.")
    sub = p.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="validate SPEC and run the whole pipeline (Prefect flow)")
    run.add_argument("spec", help="path to a YAML spec, e.g. deployments/tiny.yaml")
    val = sub.add_parser("validate", help="check SPEC and print it with every default filled in")
    val.add_argument("spec", help="path to a YAML spec")
    plan = sub.add_parser("plan", help="estimate each stage's memory for SPEC and say whether it fits")
    plan.add_argument("spec", help="path to a YAML spec")
    plan.add_argument("--gpu-memory", type=_size, help="the card's memory, e.g. 16GiB (default: this GPU's)")
    plan.add_argument("--host-memory", type=_size, help="host memory, e.g. 16GiB (default: available now)")
    return p


def _size(text: str) -> int:
    """'16GiB', '16GB', '12.5GiB' or bytes -> bytes."""
    units = {"gib": 1024**3, "gb": 10**9, "mib": 1024**2, "mb": 10**6, "": 1}
    t = text.strip().lower()
    unit = next(u for u in units if t.endswith(u))
    try:
        return int(float(t[: len(t) - len(unit)] if unit else t) * units[unit])
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size; use e.g. 16GiB or 24GB") from None


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split()) or type(exc).__name__
    return f"{type(exc).__name__}: {text}" if not str(exc).startswith(type(exc).__name__) else text


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `slimtune` command; returns the exit code."""
    args = _parser().parse_args(argv)
    from slimtune.spec import SpecError, load_spec

    try:
        spec = load_spec(args.spec)
    except SpecError as e:
        print(e, file=sys.stderr)
        print(f"slimtune: error: {len(e.problems)} problem(s) in {args.spec}", file=sys.stderr)
        return EXIT_INVALID_SPEC
    if args.command == "validate":
        print(json.dumps(spec.model_dump(mode="json"), indent=2))
        print(f"slimtune: {args.spec} is valid", file=sys.stderr)
        return 0
    if args.command == "plan":
        from slimtune.plan import detected_budget, model_config, plan, render

        budget = detected_budget(spec, args.gpu_memory, args.host_memory)
        rows, limits = plan(spec, model_config(spec), budget)
        print(render(spec, rows, limits, budget))
        return 0 if all(r.gpu_fits is not False and r.host_fits is not False for r in rows) else 1
    from slimtune.flows import finetune

    try:
        summary = finetune(spec)
    except KeyboardInterrupt:
        print("slimtune: error: interrupted", file=sys.stderr)
        return 130
    except Exception as e:  # the CLI's job: one readable line instead of a traceback as the last word
        print(f"slimtune: error: {_one_line(e)}", file=sys.stderr)
        return EXIT_FAILED
    print(f"slimtune: done; report at {summary['report']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
