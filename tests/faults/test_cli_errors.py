"""Every command ends in one line: exit 2 for input it cannot use, 130 for Ctrl-C at any moment, no traceback.

Seen before: Ctrl-C during the pre-run checks printed a 42-85-line traceback; `init`, `eval`, `chat` and
`run` gave raw tracebacks for deeply nested JSON, lone surrogates, a truncated GGUF and binary stdin; a
BOM'd JSON array was told it is not a list. Each case runs the real command in a subprocess.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from faultlib import REPO, spec_dict

from slimtune.cli.main import EXIT_INVALID_SPEC

_GOOD = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(REPO), "PYTHONIOENCODING": "utf-8"}


def _slimtune(*args: str, stdin: bytes | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "slimtune.cli.main", *args],
        input=stdin,
        capture_output=True,
        env=_env(),
        timeout=timeout,
    )


def _one_error(done: subprocess.CompletedProcess, code: int) -> str:
    """The single `slimtune: error:` line of a command that had to exit with `code` and no traceback."""
    err = done.stderr.decode(errors="replace")
    assert "Traceback" not in err, err[-3000:]
    assert done.returncode == code, f"exit {done.returncode}:\n{err[-3000:]}"
    errors = [line for line in err.splitlines() if line.startswith("slimtune: error:")]
    assert len(errors) == 1, err[-3000:]
    return errors[0]


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory) -> Path:
    """A finished run's directory as `generate`/`chat` read it: a tiny merged model and its spec."""
    from slimtune.models.tiny import save_tiny

    root = tmp_path_factory.mktemp("run") / "faults"
    save_tiny(root / "merged", "llama", hidden_size=64, intermediate_size=128, num_hidden_layers=2)
    (root / "spec.effective.yaml").write_text(yaml.safe_dump(spec_dict(root.parent)))
    return root


def _deep_json_array(tmp_path: Path) -> Path:
    path = tmp_path / "deep.json"
    path.write_text("[" + json.dumps(_GOOD) + ", " + "[" * 100_000 + "]" * 100_000 + "]")
    return path


def _lone_surrogate(tmp_path: Path) -> Path:
    path = tmp_path / "surrogate.jsonl"
    bad = json.dumps(_GOOD).replace('"hello"', '"hel\\ud800lo"')
    path.write_text(bad + "\n")
    return path


_INIT_CASES = [
    ("deeply nested JSON array", _deep_json_array, "nested deeper than 64 levels"),
    ("lone surrogate", _lone_surrogate, "surrogate"),
]


@pytest.mark.parametrize("case,make,needle", _INIT_CASES, ids=[c[0] for c in _INIT_CASES])
@pytest.mark.fault(
    "Hostile input to `slimtune init`",
    stage="cli",
    expect="exit 2 with one line naming the file; no traceback",
)
def test_init_with_hostile_data(tmp_path, case, make, needle, observe):
    data = make(tmp_path)
    line = _one_error(_slimtune("init", "--model", "builtin:tiny-llama", "--data", str(data)), EXIT_INVALID_SPEC)
    observe(line.replace(str(tmp_path), "…")[:200])
    assert str(data) in line and needle in line, line


@pytest.mark.fault(
    "BOM before a JSON array, through `slimtune init`",
    stage="cli",
    expect="the records are read (the BOM is ignored): exit 0",
)
def test_init_reads_a_bom_json_array(tmp_path):
    data = tmp_path / "bom.json"
    data.write_bytes(b"\xef\xbb\xbf" + json.dumps([_GOOD] * 4).encode())
    done = _slimtune("init", "--model", "builtin:tiny-llama", "--data", str(data))
    assert done.returncode == 0 and b"Traceback" not in done.stderr, done.stderr.decode()[-3000:]


@pytest.mark.fault(
    "Truncated GGUF in a run directory",
    stage="cli",
    expect="`slimtune generate` exits 2 with one line naming the file; no traceback",
)
def test_generate_with_a_truncated_gguf(run_dir, observe):
    pytest.importorskip("llama_cpp")
    import numpy as np
    from gguf import GGUFWriter

    gguf = run_dir / "gguf" / "faults-f16.gguf"
    gguf.parent.mkdir(exist_ok=True)
    writer = GGUFWriter(gguf, "llama")
    writer.add_tensor("token_embd.weight", np.ones((64, 256), dtype=np.float16))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    gguf.write_bytes(gguf.read_bytes()[: gguf.stat().st_size // 2])  # cut short, as by a full disk or a kill
    try:
        line = _one_error(_slimtune("generate", str(run_dir), "--prompt", "hi"), EXIT_INVALID_SPEC)
    finally:
        gguf.unlink()
    observe(line.replace(str(run_dir), "…")[:200])
    assert gguf.name in line, line


@pytest.mark.fault(
    "Binary stdin to `slimtune chat`",
    stage="cli",
    expect="exit 2 with one line (not UTF-8); no traceback",
)
def test_chat_with_binary_stdin(run_dir, observe):
    done = _slimtune("chat", str(run_dir), "--backend", "hf", "--max-new-tokens", "2", stdin=b"\xff\xfe\x00\x9c\n")
    line = _one_error(done, EXIT_INVALID_SPEC)
    observe(line[:200])
    assert "utf-8" in line.lower(), line


def _has_loaded(pid: int, library: str) -> bool:
    try:
        return library in Path(f"/proc/{pid}/maps").read_text()
    except OSError:
        return False


@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="reads /proc (Linux)")
# "background": started as a script's `slimtune validate spec.yaml &` is, with SIGINT ignored (non-interactive shells
# start background jobs that way), which Python would leave ignored
@pytest.mark.parametrize("command, sigint", [("validate", "default"), ("run", "default"), ("validate", "background")])
@pytest.mark.fault(
    "Ctrl-C during the pre-run checks",
    stage="cli",
    expect="exit 130 with one line; no traceback",
)
def test_ctrl_c_during_the_checks(tmp_path, command, sigint, observe):
    from slimtune.models.tiny import save_tiny

    model = save_tiny(tmp_path / "model", "llama", hidden_size=64, intermediate_size=128, num_hidden_layers=2)
    spec = tmp_path / "spec.yaml"
    spec.write_text(yaml.safe_dump(spec_dict(tmp_path / "runs", model={"name_or_path": str(model), "device": "cpu"})))
    proc = subprocess.Popen(
        [sys.executable, "-m", "slimtune.cli.main", command, str(spec)],
        env={k: v for k, v in _env().items() if k != "PREFECT_API_URL"} | {"PREFECT_HOME": str(tmp_path / "ph")},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        start_new_session=True,
        # a terminal job gets SIGINT's default whatever this process has (pytest run in a background job ignores it)
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN if sigint == "background" else signal.SIG_DFL),
    )
    try:
        # torch is first imported by the checks (the device check), which then build the model on the meta
        # device: seconds of work after this point, and before any flow code.
        deadline = time.monotonic() + 120
        while not _has_loaded(proc.pid, "libtorch") and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert proc.poll() is None, proc.communicate()[1].decode()[-3000:]
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=60)
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    done = subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
    line = _one_error(done, 130)
    observe(f"{command}: {line}")
