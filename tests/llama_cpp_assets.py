"""llama.cpp's copies of real tokenizers and chat templates, for tests that must run on what users bring.

llama.cpp ships in its source tree `models/ggml-vocab-*.gguf` (vocab-only GGUFs of real tokenizers, with
reference strings in `.inp` and llama.cpp's token ids for them in `.out`) and `models/templates/*.jinja`
(chat templates copied from Hub checkpoints). Both are inside the llama-cpp-python sdist that
requirements.lock pins, which pip fetches from PyPI (CI reaches it). The sdist is 77 MB; only the
`models/` folder (about 20 MB) is extracted, once per machine, into a cache outside the checkout.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def _pinned_version() -> str:
    """The llama-cpp-python version of requirements.lock: the assets are those of the llama.cpp we verify with."""
    lock = (REPO / "requirements.lock").read_text()
    found = re.search(r"^llama-cpp-python==(\S+)$", lock, re.MULTILINE)
    assert found, "requirements.lock pins no llama-cpp-python"
    return found.group(1)


def _cache_root() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "slimtune-tests"


def models_dir() -> Path:
    """llama.cpp's `models/` folder of the pinned llama-cpp-python sdist, fetched and extracted on first use.

    The extracted folder is renamed into place only when complete, so an interrupted fetch leaves nothing
    that a later call would take for the assets.
    """
    version = _pinned_version()
    target = _cache_root() / f"llama-cpp-python-{version}" / "models"
    if (target / "templates").is_dir():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        done = subprocess.run(
            [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:", "-q", "-d", tmp]
            + [f"llama-cpp-python=={version}"],
            capture_output=True,
            text=True,
        )
        if done.returncode != 0:
            raise RuntimeError(f"pip could not fetch the llama-cpp-python {version} sdist:\n{done.stderr[-2000:]}")
        (sdist,) = Path(tmp).glob("*.tar.gz")
        marker = "/vendor/llama.cpp/models/"
        staged = Path(tmp) / "models"
        with tarfile.open(sdist) as tar:
            for member in tar.getmembers():
                if marker not in member.name or not member.isfile():
                    continue
                out = staged / member.name.split(marker, 1)[1]
                out.parent.mkdir(parents=True, exist_ok=True)
                with tar.extractfile(member) as src, out.open("wb") as dst:
                    shutil.copyfileobj(src, dst)
        try:
            staged.rename(target)
        except OSError:
            if not (target / "templates").is_dir():  # another process won the race only if it finished
                raise
    return target


def vocab(name: str) -> tuple[Path, list[str], list[list[int]]]:
    """A vocab GGUF (`ggml-vocab-<name>.gguf`) with its reference strings and llama.cpp's ids for each.

    `.inp` holds the strings, each followed by a line `__ggml_vocab_test__` (as llama.cpp's
    test-tokenizer-0 reads it); `.out` holds one line of space-separated ids per string.
    """
    path = models_dir() / f"ggml-vocab-{name}.gguf"
    texts = path.with_name(path.name + ".inp").read_text(encoding="utf-8").split("\n__ggml_vocab_test__\n")
    texts = texts[:-1] if texts[-1] == "" else texts
    ids = path.with_name(path.name + ".out").read_text(encoding="utf-8").split("\n")
    ids = ids[:-1] if ids[-1] == "" else ids
    assert len(texts) == len(ids), f"{path.name}: {len(texts)} strings but {len(ids)} id lines"
    return path, texts, [[int(t) for t in line.split()] for line in ids]


def template(name: str) -> str:
    """A chat template of llama.cpp's `models/templates/` by file stem (e.g. `Qwen-Qwen3-0.6B`)."""
    return (models_dir() / "templates" / f"{name}.jinja").read_text(encoding="utf-8")
