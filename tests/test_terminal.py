"""What training prints: on a terminal one progress bar (step, ETA, loss, tokens/s); elsewhere one line per logged
step; never a step twice (Trainer's own bar used to print each log as a raw dict beside our step line).

A tiny model trains in a child process, once under a pseudo-terminal (python's `pty`, 120 columns: a real
terminal has a size, and tqdm draws nothing in 0 columns) and once into a pipe.
"""

from __future__ import annotations

import fcntl
import os
import pty
import re
import select
import struct
import subprocess
import sys
import termios
import time
from pathlib import Path

_STEPS = 4
# The child: what train_adapter prints with a console log handler, as under Prefect's console handler.
_CHILD = """
import logging, sys
from pathlib import Path
import torch
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM, AutoTokenizer
from slimtune.data import load_examples
from slimtune.spec.schema import DataSpec, TrainSpec
from slimtune.models.tiny import DATA_FILE, save_tiny
from slimtune.train.trainer import train_adapter

logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s - %(message)s")
root = Path(sys.argv[1])
base = save_tiny(root / "base", "llama", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=2, num_key_value_heads=1)
tokenizer = AutoTokenizer.from_pretrained(base)
path = root / "chat.jsonl"
path.write_text("\\n".join(DATA_FILE.read_text(encoding="utf-8").splitlines()[:44]) + "\\n", encoding="utf-8")
data = DataSpec(path=str(path), max_seq_length=96, eval_fraction=0.1)
torch.manual_seed(0)
model = get_peft_model(AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32),
                       LoraConfig(r=8, lora_alpha=16, task_type="CAUSAL_LM", target_modules=["q_proj", "v_proj"]))
train = TrainSpec(learning_rate=5e-3, max_steps=int(sys.argv[2]), logging_steps=1, save_steps=100)
train_adapter(model, tokenizer, load_examples(data, tokenizer), train, data, root / "run",
              micro_batch_size=2, gradient_accumulation_steps=1)
print("trained", flush=True)
"""


def _child(tmp_path: Path) -> list[str]:
    script = tmp_path / "child.py"
    script.write_text(_CHILD)
    return [sys.executable, str(script), str(tmp_path), str(_STEPS)]


def _run_in_a_terminal(cmd: list[str], timeout: float = 300) -> str:
    pid, fd = pty.fork()
    if pid == 0:  # the child: a 40 x 120 terminal, then the command
        fcntl.ioctl(0, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 120, 0, 0))
        os.execv(cmd[0], cmd)
    out, deadline = b"", time.monotonic() + timeout
    while time.monotonic() < deadline:
        ready, _, _ = select.select([fd], [], [], 1.0)
        if not ready:
            continue
        try:
            chunk = os.read(fd, 65536)
        except OSError:  # EIO: the child closed the terminal
            break
        if not chunk:
            break
        out += chunk
    else:
        os.kill(pid, 9)
    _, status = os.waitpid(pid, 0)
    text = out.decode(errors="replace")
    assert os.waitstatus_to_exitcode(status) == 0, text[-3000:]
    return text


def _lines(text: str) -> list[str]:
    """What stays on screen line by line: a carriage return redraws its line."""
    return [line.rsplit("\r", 1)[-1] for line in text.replace("\r\n", "\n").split("\n")]


def test_a_terminal_gets_one_bar_with_eta_loss_and_tokens_per_second(tmp_path):
    text = _run_in_a_terminal(_child(tmp_path))
    assert "trained" in text, text[-3000:]
    frames = re.findall(
        r"training: +(\d+)%\|[^|]*\| (\d+)/(\d+) \[[\d:]+<([\d:?]+), [^,\]]+, loss ([\d.]+), ([\d,]+) tok/s\]", text
    )
    assert frames, text[-3000:]
    assert {int(total) for _, _, total, _, _, _ in frames} == {_STEPS}
    assert int(frames[-1][1]) == _STEPS and re.fullmatch(r"\d\d:\d\d", frames[-1][3])  # last frame: done, ETA 00:00
    assert "{'loss'" not in text and "'eval_loss'" not in text  # Trainer's raw dicts are gone
    assert not re.search(r"step \d+/\d+ loss", text)  # the bar replaces the step lines on a terminal
    evals = [line for line in _lines(text) if re.search(r"step \d+/\d+ eval loss", line)]
    assert len(evals) == 2, evals  # the other log lines still show, above the bar: before and after training


def test_a_pipe_gets_one_line_per_logged_step_and_no_bar(tmp_path):
    done = subprocess.run(_child(tmp_path), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    out = done.stdout + done.stderr
    steps = re.findall(r"step (\d+)/\d+ loss", out)
    assert steps == [str(k) for k in range(1, _STEPS + 1)], out[-3000:]  # each step once, in order
    assert "training:" not in out and "{'loss'" not in out  # no bar, no raw dicts
