"""Can this model's tokenizer be written to GGUF with identical ids? Decided from the tokenizer files alone.

`slimtune validate` and `slimtune run` ask before any model loads, so that a tokenizer llama.cpp would read
differently stops the run in seconds instead of after training and merging. The check writes the tokenizer
exactly as the export will (`gguf_tokenizer.add_tokenizer`) into a vocab-only GGUF in a temporary folder,
and, where llama-cpp-python is installed, loads it in llama.cpp (vocab only: no weights) and compares its
ids with the Hugging Face tokenizer's on `CHECK_TEXTS`. With `export.gguf_tokenizer: as_is` the same
measurement is what the run report records.
"""

from __future__ import annotations

import ctypes
import functools
import json
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path

import gguf

from slimtune.export.gguf_quantize import llama_cpp_available
from slimtune.export.gguf_tokenizer import add_tokenizer
from slimtune.export.llama_cpp_tokenizer import CHECK_TEXTS, UnsupportedTokenizerError


@dataclass
class TokenizerCheck:
    """What the GGUF tokenizer will be: exact or not, why, and the ids measured in llama.cpp.

    Attributes:
        exact: the conversion is one llama.cpp reproduces and no measured text differed.
        reasons: why llama.cpp may tokenize differently (empty when exact).
        texts, mismatched: texts compared in llama.cpp and how many gave other ids (0/0 when not measured).
        mismatch_rate: mismatched / texts, or None when llama-cpp-python is not installed.
    """

    exact: bool
    reasons: list[str] = field(default_factory=list)
    texts: int = 0
    mismatched: int = 0
    mismatch_rate: float | None = None

    def to_dict(self) -> dict:
        return asdict(self)


def embedding_rows(config: dict) -> int:
    """The embedding rows of a config.json (multimodal configs keep them in text_config)."""
    text = config.get("text_config") or {}
    return int(config.get("vocab_size") or text["vocab_size"])


def check_tokenizer_export(model_dir: Path, n_vocab: int | None = None, *, strict: bool = True) -> TokenizerCheck:
    """Write `model_dir`'s tokenizer as the export would and measure it in llama.cpp.

    Args:
        n_vocab: the embedding rows the GGUF will have (default: config.json's vocab_size).
        strict: as `add_tokenizer`'s; False measures what `export.gguf_tokenizer: as_is` writes.

    Raises:
        UnsupportedTokenizerError: the tokenizer cannot be written (with strict: or not with identical ids).
    """
    model_dir = Path(model_dir)
    if n_vocab is None:
        n_vocab = embedding_rows(json.loads((model_dir / "config.json").read_text(encoding="utf-8")))
    with tempfile.TemporaryDirectory(prefix="slimtune-vocab-") as tmp:
        path = Path(tmp) / "vocab.gguf"
        writer = gguf.GGUFWriter(path, "llama")  # the tokenizer only: llama.cpp loads it with vocab_only
        reasons = add_tokenizer(writer, model_dir, n_vocab, strict=strict)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        writer.close()
        if not llama_cpp_available():
            return TokenizerCheck(exact=not reasons, reasons=reasons)
        mismatched = _mismatched_texts(path, model_dir)
    check = TokenizerCheck(
        exact=not reasons and not mismatched,
        reasons=reasons,
        texts=len(CHECK_TEXTS),
        mismatched=len(mismatched),
        mismatch_rate=len(mismatched) / len(CHECK_TEXTS),
    )
    if strict and mismatched:
        raise UnsupportedTokenizerError(
            f"{model_dir}: llama.cpp gives other ids than the HF tokenizer on {len(mismatched)} of "
            f"{len(CHECK_TEXTS)} check texts (first: {mismatched[0][:40]!r})"
        )
    return check


def _mismatched_texts(vocab_gguf: Path, model_dir: Path) -> list[str]:
    import llama_cpp
    from transformers import AutoTokenizer

    from slimtune.export.gguf_verify import llama_cpp_tokenize

    hf_tok = AutoTokenizer.from_pretrained(model_dir)
    with _llama_cpp_silenced():
        llm = llama_cpp.Llama(str(vocab_gguf), vocab_only=True, verbose=False)
    try:
        return [t for t in CHECK_TEXTS if llama_cpp_tokenize(llm, t) != hf_tok(t)["input_ids"]]
    finally:
        llm.close()


@contextmanager
def _llama_cpp_silenced() -> Iterator[None]:
    """llama.cpp's log off while the vocab-only context is made: with verbose=False it still prints
    "n_ctx_seq (512) > n_ctx_train (0) -- possible training context overflow" at error level, a false alarm
    in `slimtune validate`'s output (a vocabulary has no training context). llama-cpp-python's own log
    callback is put back afterwards."""
    import llama_cpp
    import llama_cpp._logger

    llama_cpp.llama_log_set(_quiet_log(), ctypes.c_void_p(0))
    try:
        yield
    finally:
        llama_cpp.llama_log_set(llama_cpp._logger.llama_log_callback, ctypes.c_void_p(0))


@functools.cache
def _quiet_log() -> object:
    """A log callback that drops every line; cached so that the C side never calls a freed ctypes object."""
    import llama_cpp

    return llama_cpp.llama_log_callback(lambda level, text, user_data: None)


def tokenizer_export_problem(model_dir: Path, *, as_is: bool = False) -> str | None:
    """One line for `slimtune validate`/`run` when the GGUF tokenizer cannot be written as asked, else None."""
    try:
        check_tokenizer_export(model_dir, strict=not as_is)
    except OSError as e:  # no or unreadable tokenizer files: training could not run either
        return f"model.name_or_path: the tokenizer in {model_dir} cannot be loaded ({' '.join(str(e).split())})"
    except UnsupportedTokenizerError as e:
        if as_is:  # not even a differing vocabulary can be written
            return f"export.gguf: the tokenizer cannot be written to GGUF: {' '.join(str(e).split())}"
        return (
            f"export.gguf: the tokenizer cannot be written to GGUF with identical ids: {' '.join(str(e).split())}; "
            "drop export.gguf (export.gguf: []), or set export.gguf_tokenizer: as_is to write it anyway with the "
            "measured mismatch rate in the report"
        )
    return None
