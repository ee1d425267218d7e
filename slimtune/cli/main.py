"""Command line: `slimtune run|validate|plan SPEC [--set a.b=value]`, `deploy`, `init`, `generate`, `chat`, `eval`.

Failures end with one line, `slimtune: error: <reason>`, and a non-zero exit code, so that scripts and
schedulers can tell what went wrong without reading a traceback.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys

from slimtune import __version__
from slimtune.cli.sizes import parse_size
from slimtune.core.bounded import clip

# Prefect reads its settings at import; telemetry calls fail without internet and only add noise, and
# the embedded server's 20 s start-up limit is too short on a busy 2-core machine (seen: >20 s).
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "120")
os.environ.setdefault("DO_NOT_TRACK", "1")  # the client's telemetry, and its first-run notice on a terminal

EXIT_INVALID_SPEC = 2  # also any bad input (a run dir, a data file) found before a model is loaded
EXIT_FAILED = 1


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="slimtune", description="QLoRA fine-tuning to GGUF as one Prefect flow.")
    p.add_argument("--version", action="version", version=f"slimtune {__version__}")
    sub = p.add_subparsers(dest="command", required=True)  # in workflow order: `--help` lists them so
    _add_init_command(sub)
    val = sub.add_parser("validate", help="check SPEC and print it with every default filled in (YAML)")
    val.add_argument("spec", help="path to a YAML spec")
    add_set_argument(val)
    val.add_argument("--json", action="store_true", help="print JSON instead of YAML")
    plan = sub.add_parser("plan", help="estimate each stage's memory for SPEC and say whether it fits")
    plan.add_argument("spec", help="path to a YAML spec")
    plan.add_argument(
        "--gpu-memory", type=_size, help="the card's memory, e.g. 16GiB (bare number: GiB; default: this GPU's)"
    )
    plan.add_argument(
        "--host-memory", type=_size, help="host memory, e.g. 16GiB (bare number: GiB; default: available now)"
    )
    add_set_argument(plan)
    run = sub.add_parser("run", help="validate SPEC and run the whole pipeline (Prefect flow)")
    run.add_argument("spec", help="path to a YAML spec, e.g. deployments/tiny.yaml")
    add_set_argument(run)
    run.add_argument(
        "--verbose", action="store_true", help="also show Prefect's notices, library warnings and MLflow's INFO lines"
    )
    dep = sub.add_parser("deploy", help="register SPEC as a Prefect deployment, its runs sized by the plan")
    dep.add_argument("spec", help="path to a YAML spec")
    dep.add_argument("--pool", required=True, help="the work pool of its runs (merge and GGUF: pools.export's)")
    dep.add_argument(
        "--cron", action="append", default=[], help="a schedule, cron in UTC (repeatable), e.g. '0 3 * * *'"
    )
    dep.add_argument(
        "--source", help="where workers get slimtune: a git URL (cloned per run) or a folder (default: this checkout)"
    )
    add_set_argument(dep)
    _add_workflow_commands(sub)
    for command in sub.choices.values():
        command.add_argument(
            "--debug", action="store_true", help="show tracebacks (hidden by default: one line per error)"
        )
    return p


def add_set_argument(parser: argparse.ArgumentParser) -> None:
    """`--set a.b=value` (repeatable) on a subcommand that reads a spec."""
    parser.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="FIELD=VALUE",
        help="override a spec field by its dotted path, value as YAML (repeatable), e.g. --set lora.r=32",
    )


def _add_init_command(sub) -> None:
    """init runs its own function (`func`), not the spec path of run/validate."""
    init = sub.add_parser("init", help="write a commented starting spec for a model and a data file to stdout")
    init.add_argument("--model", required=True, help="Hub id, local model directory or builtin:tiny-<family>")
    init.add_argument("--data", required=True, help="a local .jsonl/.json/.parquet training file")
    init.add_argument(
        "--gpu-memory", type=_size, default=None, help="GPU memory to plan for, e.g. 16GiB or 24GB (bare number: GiB)"
    )
    init.add_argument("--name", default=None, help="run name (default: from the model and data names)")
    init.set_defaults(func=_cmd_init)


def _add_workflow_commands(sub) -> None:
    """eval, generate and chat: each runs its own function (`func`), not the spec path of run/validate."""
    ev = sub.add_parser("eval", help="loss and perplexity of a finished run's merged model on a data file")
    ev.add_argument("run_dir", help="a finished run's directory (output_dir/name)")
    ev.add_argument("--data", required=True, help="a .jsonl/.json/.parquet file in the run's data format")
    ev.add_argument("--base", action="store_true", help="also evaluate the base model, for comparison")
    ev.add_argument("--json", action="store_true", help="print JSON instead of YAML")
    ev.set_defaults(func=_cmd_eval)
    for name, helptext in (
        ("generate", "complete one prompt with a finished run's model"),
        ("chat", "talk to a finished run's model (reads turns from stdin; empty line or EOF ends)"),
    ):
        cmd = sub.add_parser(name, help=helptext)
        cmd.add_argument("run_dir", help="a finished run's directory (output_dir/name)")
        if name == "generate":
            cmd.add_argument("--prompt", required=True, help="the prompt (sent as one user turn when --chat)")
            cmd.add_argument("--chat", action="store_true", help="apply the chat template to the prompt")
        cmd.add_argument(
            "--backend",
            choices=("llama", "hf"),
            default="llama",
            help="llama = llama.cpp on the GGUF; hf = transformers on merged/",
        )
        cmd.add_argument("--gguf", default=None, help="which GGUF file of the run (default: the largest type)")
        cmd.add_argument("--max-new-tokens", type=int, default=128, help="tokens to generate per reply")
        cmd.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (the default)")
        cmd.set_defaults(func=_cmd_generate if name == "generate" else _cmd_chat)


def _size(text: str) -> int:
    """argparse type for memory sizes; the rule (a bare number is GiB) is `slimtune.cli.sizes.parse_size`."""
    try:
        return parse_size(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _one_line(exc: BaseException) -> str:
    text = clip(" ".join(str(exc).split()), 1000) or type(exc).__name__  # an error can quote any input
    return f"{type(exc).__name__}: {text}" if not str(exc).startswith(type(exc).__name__) else text


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `slimtune` command; returns the exit code.

    Whatever a command meets ends in one line: exit 2 for input it cannot use, 130 for Ctrl-C at any moment
    (imports and pre-run checks included), 1 for anything else; `--debug` shows the traceback instead.
    """
    debug = "--debug" in (sys.argv[1:] if argv is None else argv)
    # A script's background job (`slimtune run spec.yaml &`) starts with SIGINT ignored, and Python then leaves it
    # ignored; `slimtune run` handles it once the flow starts (slimtune.cli.interrupt), so the checks before do too.
    if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        return _command(_parser().parse_args(argv))
    except KeyboardInterrupt:
        print("slimtune: error: interrupted", file=sys.stderr)
        return 130
    except SystemExit:
        raise
    except BaseException as e:  # BaseException: tokenizers' Rust panics (pyo3 PanicException) are not Exceptions
        if debug:
            raise
        return _fail(e, EXIT_INVALID_SPEC if _bad_input(e) else EXIT_FAILED)


def _bad_input(exc: BaseException) -> bool:
    """True for errors about what the user gave (a file, a spec, stdin), as opposed to failures of the run."""
    from slimtune.cli.scaffold import ScaffoldError
    from slimtune.core.bounded import NestingError
    from slimtune.data import DataError
    from slimtune.inference.generate import PromptTooLong, RunDirError
    from slimtune.models.source import ModelSourceError
    from slimtune.spec.schema import SpecError

    typed = (NestingError, DataError, PromptTooLong, RunDirError, ModelSourceError, ScaffoldError, SpecError)
    return isinstance(exc, (*typed, UnicodeError))


def _command(args: argparse.Namespace) -> int:
    if getattr(args, "func", None) is not None:
        return args.func(args)
    from slimtune.checks.problems import prefect_home_problems, spec_problems
    from slimtune.models.source import ModelSourceError, architecture_problem
    from slimtune.spec.schema import SpecError, load_spec

    try:
        spec = load_spec(args.spec, args.overrides)
    except SpecError as e:
        print(e, file=sys.stderr)
        print(f"slimtune: error: {len(e.problems)} problem(s) in {args.spec}", file=sys.stderr)
        return EXIT_INVALID_SPEC
    try:
        problem = architecture_problem(spec.model)
    except ModelSourceError as e:  # an unreadable config.json
        problem = str(e)
    if problem:  # one line: nothing else matters for a model we cannot read or run
        print(f"slimtune: error: {problem}", file=sys.stderr)
        return EXIT_INVALID_SPEC
    if args.command == "run" and not prefect_home_problems():  # the one check the server itself needs
        from slimtune.cli.console import quiet_start
        from slimtune.cli.interrupt import start_prefect_server_in_background

        if not args.verbose:
            quiet_start()
        server_started = start_prefect_server_in_background()  # it boots while the checks and the flow import
    # The machine and the files the spec names, before any model loads. Not for `plan`, which answers "would
    # this fit that card?" on any machine, nor `deploy`, which registers runs for other machines.
    if args.command not in ("plan", "deploy") and (problems := spec_problems(spec)):
        print(SpecError(problems, args.spec), file=sys.stderr)
        print(f"slimtune: error: {len(problems)} problem(s) in {args.spec}", file=sys.stderr)
        return EXIT_INVALID_SPEC
    if args.command == "validate":
        return _print_validated(args, spec)
    if args.command == "plan":
        from slimtune.plan.fit import detected_budget, model_config, plan, render

        budget = detected_budget(spec, args.gpu_memory, args.host_memory)
        try:  # plan reads a multimodal checkpoint's safetensors headers too
            rows, limits = plan(spec, model_config(spec), budget)
        except ModelSourceError as e:
            return _fail(e, EXIT_INVALID_SPEC)
        print(render(spec, rows, limits, budget))
        return 0 if all(r.gpu_runs is not False and r.host_fits is not False for r in rows) else 1
    if args.command == "deploy":
        return _deploy(args, spec)
    from prefect.exceptions import TerminationSignal

    from slimtune.cli.console import hide_tracebacks
    from slimtune.cli.interrupt import Interrupted, exit_code, exit_now, interruptible
    from slimtune.data import DataError
    from slimtune.flows.run_lock import RunLocked, run_lock

    try:
        with run_lock(spec.run_dir()), interruptible():
            from slimtune.flows.finetune import finetune

            if not args.debug:
                hide_tracebacks()  # after the flow's import: importing Prefect's flow API configures its logging
            server_started()
            summary = finetune(spec)
    except (RunLocked, SpecError, DataError, ModelSourceError) as e:  # bad input found by the flow itself
        print(f"slimtune: error: {_one_line(e)}", file=sys.stderr)
        return EXIT_INVALID_SPEC
    except (Interrupted, TerminationSignal) as e:  # SIGTERM may surface as Prefect's TerminationSignal
        signum = getattr(e, "signum", getattr(e, "signal", 15))
        name = signal.Signals(signum).name
        print(
            f"slimtune: error: interrupted ({name}); run it again to resume from the last checkpoint", file=sys.stderr
        )
        exit_now(exit_code(signum))
    except KeyboardInterrupt:
        print("slimtune: error: interrupted", file=sys.stderr)
        return 130
    except Exception as e:  # the CLI's job: one readable line instead of a traceback as the last word
        print(f"slimtune: error: {_one_line(e)}", file=sys.stderr)
        return EXIT_FAILED
    from slimtune.report.run_report import done_line

    print(done_line(summary))
    return 0


def _print_validated(args: argparse.Namespace, spec) -> int:
    """The effective spec: readable YAML by default, JSON with --json (for scripts)."""
    if args.json:
        print(json.dumps(spec.model_dump(mode="json"), indent=2))
    else:
        import yaml

        print(yaml.safe_dump(spec.model_dump(mode="json"), sort_keys=False), end="")
    print(f"slimtune: {args.spec} is valid", file=sys.stderr)
    return 0


def _deploy(args: argparse.Namespace, spec) -> int:
    """`slimtune deploy SPEC --pool POOL`: what was registered (JSON), or one line and exit 2 for bad input."""
    from slimtune.cli.deploy import DeployError, deploy
    from slimtune.models.source import ModelSourceError

    try:
        done = deploy(spec, args.pool, crons=args.cron, source=args.source)
    except (DeployError, ModelSourceError) as e:
        return _fail(e, EXIT_INVALID_SPEC)
    print(json.dumps(done, indent=2))
    return 0


def _fail(exc: BaseException, code: int) -> int:
    print(f"slimtune: error: {_one_line(exc)}", file=sys.stderr)
    return code


def _cmd_init(args: argparse.Namespace) -> int:
    """`slimtune init`: a commented spec on stdout; bad input exits 2 before any model is loaded."""
    from slimtune.cli.scaffold import ScaffoldError, scaffold_spec

    try:
        print(scaffold_spec(args.model, args.data, gpu_memory=args.gpu_memory, name=args.name), end="")
    except ScaffoldError as e:
        return _fail(e, EXIT_INVALID_SPEC)
    return 0


def _generator(args: argparse.Namespace):
    from slimtune.inference.generate import open_generator

    return open_generator(args.run_dir, backend=args.backend, gguf=args.gguf)


def _cmd_generate(args: argparse.Namespace) -> int:
    """`slimtune generate RUN_DIR --prompt ...`: the completion on stdout."""
    from slimtune.inference.generate import PromptTooLong, RunDirError

    try:
        gen = _generator(args)
        if args.chat:
            text = gen.chat([{"role": "user", "content": args.prompt}], args.max_new_tokens, args.temperature)
        else:
            text = gen.complete(args.prompt, args.max_new_tokens, args.temperature)
    except (RunDirError, PromptTooLong) as e:
        return _fail(e, EXIT_INVALID_SPEC)
    print(text)
    return 0


def _cmd_chat(args: argparse.Namespace) -> int:
    """`slimtune chat RUN_DIR`: one user turn per stdin line, replies on stdout, the history kept."""
    from slimtune.inference.generate import RunDirError, chat_loop

    try:
        gen = _generator(args)
    except RunDirError as e:
        return _fail(e, EXIT_INVALID_SPEC)
    try:
        chat_loop(
            gen, sys.stdin, sys.stdout, sys.stderr, max_new_tokens=args.max_new_tokens, temperature=args.temperature
        )
    except KeyboardInterrupt:  # Ctrl-C at the prompt ends the chat, as EOF does (while loading: exit 130)
        print(file=sys.stdout)
    return 0


def _cmd_eval(args: argparse.Namespace) -> int:
    """`slimtune eval RUN_DIR --data FILE`: loss and perplexity (YAML, or JSON with --json)."""
    from slimtune.data import DataError
    from slimtune.inference.evaluate import evaluate_file
    from slimtune.inference.generate import RunDirError

    if not os.path.isfile(args.data):  # the data layer's own message names the spec's field, data.path
        print(
            f"slimtune: error: --data {args.data}: file not found; give a .jsonl/.json/.parquet file", file=sys.stderr
        )
        return EXIT_INVALID_SPEC
    try:
        result = evaluate_file(args.run_dir, args.data, include_base=args.base)
    except (RunDirError, DataError) as e:
        return _fail(e, EXIT_INVALID_SPEC)
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        import yaml

        print(yaml.safe_dump(result, sort_keys=False), end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
