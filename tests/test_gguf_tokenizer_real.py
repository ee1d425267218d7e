"""Real tokenizers through the GGUF export: llama.cpp's ids on the exported file equal llama.cpp's reference ids.

Each vocabulary is one of llama.cpp's `models/ggml-vocab-*.gguf` (`llama_cpp_assets.vocab`), turned into the files
a Hub checkpoint has: byte-level BPE ones as a tokenizer.json with the Hub's pre-tokenizer (built here with
`tokenizers` from the GGUF's tokens and merges; transformers' own rebuild takes 80 s per 150k vocabulary on two
cores and drops Llama 3's ignore_merges), SentencePiece ones by transformers' rebuild from the GGUF
(tokenizer.json only, as Phi-3's failing case was) plus, for llama-spm, the tokenizer.model a Llama 2 checkpoint
ships. The tokenizer goes on a tiny random model of the family (one layer, hidden 64, so that a 262k vocabulary
is 17M parameters), through `slimtune run` (train, merge, f16 GGUF), and the GGUF is loaded in llama.cpp with
vocab_only. The tokenizer a GGUF gets does not depend on its weight type
(`test_every_weight_type_gets_the_same_tokenizer`), so one type per vocabulary is enough.
"""

from __future__ import annotations

import json
import struct
import subprocess
import sys
from pathlib import Path

import gguf
import pytest
from llama_cpp_assets import vocab

from slimtune.export import convert_hf_to_gguf
from slimtune.export.gguf_header import read_header

llama_cpp = pytest.importorskip("llama_cpp")

# vocabulary -> the slimtune family its model is built as (Qwen3.5's on a Qwen3 model: the tokenizer half of the
# GGUF does not depend on the architecture, and the qwen3_5_text family's own GGUF is tests/test_family_qwen35.py's).
VOCABS = {
    "llama-bpe": "llama",
    "llama-spm": "llama",
    "qwen2": "qwen2",
    "qwen35": "qwen3",
    "phi-3": "phi3",
    "gemma-4": "gemma4_text",
}
# The `runs` fixture builds the checkpoints one by one and starts each run once its checkpoint is there: longest
# run first, so that no run is left alone on the cores at the end. Measured with all six at once on 2 loaded
# cores: gemma-4 (262k vocabulary, per-layer embeddings) ~280 s, the byte-level BPE ones 220-260 s, the
# SentencePiece ones 160-185 s; started in VOCABS order, gemma-4 began last and ran alone for its last 50-80 s.
_START_ORDER = ("gemma-4", "llama-bpe", "qwen35", "qwen2", "phi-3", "llama-spm")
assert sorted(_START_ORDER) == sorted(VOCABS)
# the llama.cpp vocabulary each must be written as: (tokenizer.ggml.model, tokenizer.ggml.pre)
WRITTEN_AS = {
    "llama-bpe": ("gpt2", "llama-bpe"),
    "llama-spm": ("llama", "default"),
    "qwen2": ("gpt2", "qwen2"),
    "qwen35": ("gpt2", "qwen35"),
    "phi-3": ("llama", "default"),
    "gemma-4": ("gemma4", None),  # llama.cpp's own Gemma 4 tokenizer model: no pre-tokenizer key, as in its file
}
_LLAMA3 = (
    "(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}{1,3}"
    "| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+"
)
_QWEN2 = (
    "(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}"
    "| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+"
)
_QWEN35 = (
    "(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?[\\p{L}\\p{M}]+|\\p{N}"
    "| ?[^\\s\\p{L}\\p{M}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+"
)
# byte-level BPE vocabularies: (Split regex, NFC normalizer, ignore_merges, BOS added) as their Hub tokenizer.json
_BYTE_LEVEL = {
    "llama-bpe": (_LLAMA3, False, True, True),
    "qwen2": (_QWEN2, True, False, False),
    "qwen35": (_QWEN35, True, False, False),
}


def _gguf_vocab(path: Path) -> tuple[list[str], list[int], list[str], dict]:
    """(tokens, token types, merges, the other tokenizer keys) of a vocab GGUF."""
    kv = read_header(path).kv
    scalars = {k: v for k, v in kv.items() if k.endswith(("_token_id", "add_bos_token"))}
    return kv["tokenizer.ggml.tokens"], kv["tokenizer.ggml.token_type"], kv.get("tokenizer.ggml.merges", []), scalars


def _hf_from_tokens(tokens, types, merges, scalars, backend):
    from tokenizers import AddedToken, processors
    from transformers import PreTrainedTokenizerFast

    control = [t for t, ty in zip(tokens, types) if ty == gguf.TokenType.CONTROL]
    user = [t for t, ty in zip(tokens, types) if ty == gguf.TokenType.USER_DEFINED]
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in control])
    backend.add_tokens([AddedToken(t, special=False, normalized=False) for t in user])
    bos_id = scalars.get("tokenizer.ggml.bos_token_id")
    bos = tokens[bos_id] if bos_id is not None else None
    if scalars.get(
        "tokenizer.ggml.add_bos_token", bos is not None and bos_id != scalars.get("tokenizer.ggml.eos_token_id")
    ):
        backend.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, bos_id)]
        )
    eos_id = scalars.get("tokenizer.ggml.eos_token_id")
    return PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token=bos, eos_token=tokens[eos_id] if eos_id is not None else None
    )


def _byte_level_tokenizer(name: str, path: Path):
    """The Hub's tokenizer.json shape of a byte-level BPE vocabulary, from the vocab GGUF's tokens and merges."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers

    regex, nfc, ignore_merges, adds_bos = _BYTE_LEVEL[name]
    tokens, types, merges, scalars = _gguf_vocab(path)
    bpe = models.BPE(
        {t: i for i, t in enumerate(tokens)}, [tuple(m.split(" ", 1)) for m in merges], ignore_merges=ignore_merges
    )
    backend = Tokenizer(bpe)
    backend.normalizer = normalizers.NFC() if nfc else None
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(regex), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    backend.decoder = decoders.ByteLevel()
    return _hf_from_tokens(tokens, types, merges, scalars | {"tokenizer.ggml.add_bos_token": adds_bos}, backend)


def _gemma4_tokenizer(path: Path):
    """Gemma 4's tokenizer.json shape: BPE with byte fallback over text whose spaces are "▁", split at newlines."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers

    tokens, types, merges, scalars = _gguf_vocab(path)
    bpe = models.BPE(
        {t: i for i, t in enumerate(tokens)},
        [tuple(m.split(" ", 1)) for m in merges],
        byte_fallback=True,
        unk_token=tokens[scalars["tokenizer.ggml.unknown_token_id"]],
        fuse_unk=True,
    )
    backend = Tokenizer(bpe)
    backend.normalizer = normalizers.Replace(" ", "\u2581")
    backend.pre_tokenizer = pre_tokenizers.Split(Regex("[^\\n]+|[\\n]+"), behavior="isolated")
    backend.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()])
    return _hf_from_tokens(tokens, types, merges, scalars, backend)


def _proto_field(number: int, wire: int, payload: bytes) -> bytes:
    return _varint(number << 3 | wire) + (_varint(len(payload)) + payload if wire == 2 else payload)


def _varint(value: int) -> bytes:
    out = bytearray()
    while True:
        out.append(value & 0x7F | (0x80 if value > 0x7F else 0))
        value >>= 7
        if not value:
            return bytes(out)


def _write_sentencepiece_model(path: Path, gguf_path: Path) -> None:
    """tokenizer.model (SentencePiece ModelProto) of a SentencePiece vocab GGUF: its pieces, scores and types, a
    BPE model with byte fallback, and Llama 2's normalizer spec (identity, dummy prefix, spaces kept)."""
    kv = read_header(gguf_path).kv
    pieces, scores, types = kv["tokenizer.ggml.tokens"], kv["tokenizer.ggml.scores"], kv["tokenizer.ggml.token_type"]
    out = bytearray()
    for piece, score, kind in zip(pieces, scores, types):
        body = _proto_field(1, 2, piece.encode()) + _proto_field(2, 5, struct.pack("<f", score))
        out += _proto_field(1, 2, body + _proto_field(3, 0, _varint(kind)))
    out += _proto_field(2, 2, _proto_field(3, 0, _varint(2)) + _proto_field(35, 0, _varint(1)))
    out += _proto_field(
        3, 2, _proto_field(1, 2, b"identity") + _proto_field(3, 0, _varint(1)) + _proto_field(4, 0, _varint(0))
    )
    path.write_bytes(bytes(out))


def _checkpoint(name: str, dest: Path) -> Path:
    """A tiny model of the vocabulary's family with the tokenizer files its Hub checkpoint would have."""
    from transformers import AutoTokenizer

    from slimtune.models.tiny import build_model

    path, _, _ = vocab(name)
    if name in _BYTE_LEVEL:
        tokenizer = _byte_level_tokenizer(name, path)
    elif name == "gemma-4":
        tokenizer = _gemma4_tokenizer(path)
    else:  # SentencePiece: transformers' rebuild (tokenizer.json with Metaspace or Prepend+Replace, byte fallback)
        tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    tokenizer.save_pretrained(dest)
    if name == "llama-spm":
        _write_sentencepiece_model(dest / "tokenizer.model", path)
    family = VOCABS[name]
    layers = 2 if name == "gemma-4" else 1  # gemma4: a sliding layer, then the global last one
    tiny = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=layers, num_attention_heads=2)
    tiny |= dict(num_key_value_heads=1, head_dim=32)
    build_model(family, len(tokenizer), **tiny).save_pretrained(dest)
    return dest


class _Runs:
    """The runs started by the `runs` fixture; `runs[name]` waits for that one only, so that a test checks its run
    while the others still go (gemma-4's, the longest, runs alone on the two cores for its last 50-90 s)."""

    def __init__(self, root: Path):
        self.root = root
        self.procs: dict[str, subprocess.Popen] = {}
        self.done: dict[str, tuple[subprocess.CompletedProcess, Path]] = {}

    def __getitem__(self, name: str) -> tuple[subprocess.CompletedProcess, Path]:
        if name not in self.done:
            proc = self.procs[name]
            proc.wait(timeout=1200)
            out, err = ((self.root / name / stream).read_text(errors="replace") for stream in ("stdout", "stderr"))
            completed = subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
            self.done[name] = (completed, self.root / "runs" / f"real-{name}")
        return self.done[name]

    def stop(self) -> None:
        """Kill the runs no test waited for (a `-k` selection, a failed test)."""
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()


@pytest.fixture(scope="module")
def runs(tmp_path_factory, request) -> _Runs:
    """`slimtune run` on a tiny model with each real vocabulary (two steps, merge, f16 GGUF verified in llama.cpp),
    all at once against one Prefect server: each run alone spends most of its ~100 s starting.
    Returns once all are started; `runs[name]` waits for one."""
    from prefect_server import start_server

    root = tmp_path_factory.mktemp("real-vocab-runs")
    # The server boots while the first checkpoint is built (both ~25 s on a loaded 2-core machine).
    server = start_server(root / "prefect", request.addfinalizer, wait=False)
    started = _Runs(root)
    request.addfinalizer(started.stop)
    for name in _START_ORDER:
        path, texts, _ = vocab(name)
        model_dir = _checkpoint(name, root / name / "model")
        data = root / name / "d.jsonl"
        data.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts if len(t.strip()) > 8) * 4)
        spec = root / name / "s.yaml"
        spec.write_text(
            f"name: real-{name}\noutput_dir: {root / 'runs'}\nmodel: {{name_or_path: {model_dir}, device: cpu}}\n"
            "lora: {r: 4, alpha: 8, gradient_checkpointing: false}\n"
            f"data: {{path: {data}, max_seq_length: 64, eval_fraction: 0}}\n"
            "train: {micro_batch_size: 2, max_steps: 2, save_steps: 2, seed: 0}\n"
            # f16 only: a q8_0 file gets the same tokenizer (test_every_weight_type_gets_the_same_tokenizer), and
            # writing and verifying it was ~40% of these runs' export stage (a 128k-262k vocabulary per file)
            "export: {gguf: [f16]}\n"
        )
        cmd = [sys.executable, "-m", "slimtune.cli.main", "run", str(spec)]
        # each run its own GPU slot (SLIMTUNE_GPU_SLOT): CPU runs, which would otherwise take turns on the one slot
        env = {**server.env, "SLIMTUNE_GPU_SLOT": f"real-{name}"}
        if not started.procs:
            server.wait_healthy()
        # output to files, not pipes: a run whose pipe fills (64 KiB) would stop until its turn to be read
        with (root / name / "stdout").open("w") as out, (root / name / "stderr").open("w") as err:
            started.procs[name] = subprocess.Popen(cmd, env=env, stdout=out, stderr=err)
    return started


# gemma-4's run ends last: its test is the module's last (below), so that the tests in between run while it finishes.
@pytest.mark.parametrize("name", [name for name in VOCABS if name != "gemma-4"])
def test_slimtune_run_exports_the_real_vocabulary(name, runs):
    """The user's path: the run exits 0, its GGUF is written as llama.cpp's own vocabulary (SentencePiece from
    tokenizer.model with its scores, BPE with the pre-tokenizer llama.cpp names), and llama.cpp's ids on it
    equal llama.cpp's reference ids on every reference string."""
    _check_exported_vocabulary(name, runs)


def _check_exported_vocabulary(name: str, runs: _Runs) -> None:
    path, texts, reference = vocab(name)
    done, run_dir = runs[name]
    assert done.returncode == 0, done.stderr[-3000:]
    gguf_path = run_dir / "gguf" / f"real-{name}-f16.gguf"
    written = read_header(gguf_path).kv
    assert (written["tokenizer.ggml.model"], written.get("tokenizer.ggml.pre")) == WRITTEN_AS[name]
    if name == "llama-spm":  # from tokenizer.model: sentencepiece's own scores, not ones derived from merges
        assert written["tokenizer.ggml.scores"] == read_header(path).kv["tokenizer.ggml.scores"]
    llm = llama_cpp.Llama(str(gguf_path), vocab_only=True, verbose=False)
    got = [llm.tokenize(t.encode("utf-8"), add_bos=False, special=False) for t in texts]
    llm.close()
    bad = [(t, g, r) for t, g, r in zip(texts, got, reference) if g != r]
    print(f"{name}: llama.cpp ids = reference on {len(texts) - len(bad)}/{len(texts)} strings")
    assert not bad, f"{name}: {len(bad)}/{len(texts)} differ, first {bad[0]}"


@pytest.mark.parametrize("tokenizer", ["bpe", "sentencepiece"])
def test_every_weight_type_gets_the_same_tokenizer(tokenizer, tmp_path):
    """The tokenizer keys of a GGUF are the same, value for value, whichever weight type the converter writes
    (`add_tokenizer` never sees the type): what the real-vocabulary runs prove on their f16 GGUF holds for q8_0
    and the rest. Both of llama.cpp's tokenizer models: byte-level BPE ("gpt2") and SentencePiece-style BPE with byte
    fallback and scores ("llama")."""
    from slimtune.export.gguf_quantize import CONVERTER_TYPES
    from slimtune.models.tiny import build_model, build_spm_tokenizer, build_tokenizer

    model_dir = tmp_path / "m"
    hf = build_tokenizer() if tokenizer == "bpe" else build_spm_tokenizer()
    hf.save_pretrained(model_dir)
    build_model("llama", len(hf), hidden_size=64, intermediate_size=128, num_hidden_layers=1).save_pretrained(model_dir)
    keys = {}
    for out_type in CONVERTER_TYPES:
        [path] = convert_hf_to_gguf(model_dir, tmp_path / f"m-{out_type}.gguf", out_type)
        keys[out_type] = {k: v for k, v in read_header(path).kv.items() if k.startswith("tokenizer.")}
    assert len(keys["f16"]["tokenizer.ggml.tokens"]) == len(hf)
    assert keys["f16"]["tokenizer.ggml.model"] == {"bpe": "gpt2", "sentencepiece": "llama"}[tokenizer]
    assert ("tokenizer.ggml.scores" in keys["f16"]) == (tokenizer == "sentencepiece")
    assert {"f16", "q8_0"} <= keys.keys()
    for out_type, got in keys.items():
        assert got == keys["f16"], out_type


def test_probe_hash_names_the_pre_tokenizer_of_an_unknown_shape():
    """A Llama 3 tokenizer.json whose regex is spelled differently (llama.cpp's own case-insensitive rewrite) is no
    known shape; llama.cpp's probe-text hash still names it, and ignore_merges picks llama-bpe or its twin."""
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    from slimtune.export.gguf_pre_hashes import KNOWN_PRE_TOKENIZERS, probe_hash
    from slimtune.export.llama_cpp_tokenizer import UnsupportedTokenizerError, pre_tokenizer_name

    path, _, _ = vocab("llama-bpe")
    tj = json.loads(_byte_level_tokenizer("llama-bpe", path).backend_tokenizer.to_str())
    tj["pre_tokenizer"]["pretokenizers"][0]["pattern"]["Regex"] = _LLAMA3.replace(
        "(?i:'s|'t|'re|'ve|'m|'ll|'d)", "(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"
    )

    def named(ignore_merges: bool) -> str:
        t = tj | {"model": tj["model"] | {"ignore_merges": ignore_merges}}
        hf = PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(json.dumps(t)), bos_token="<|begin_of_text|>")
        assert probe_hash(hf) in KNOWN_PRE_TOKENIZERS
        return pre_tokenizer_name(t, "t", hf)

    assert named(True) == "llama-bpe" and named(False) == "smaug-bpe"
    with pytest.raises(UnsupportedTokenizerError, match="matches none"):
        pre_tokenizer_name(tj, "t")  # without the tokenizer to hash, the shape alone decides


def test_validate_refuses_an_inexact_tokenizer_before_any_model_loads(tmp_path):
    """A Llama 3 tokenizer.json that lost ignore_merges with a regex llama.cpp has no twin for: validate exits 2
    naming the choices, before any model loads."""
    from slimtune.models.tiny import build_tokenizer

    model_dir = tmp_path / "m"
    tokenizer = build_tokenizer()
    tokenizer.save_pretrained(model_dir)
    tj = json.loads((model_dir / "tokenizer.json").read_text())
    tj["normalizer"] = {"type": "Lowercase"}  # llama.cpp lower-cases nothing
    (model_dir / "tokenizer.json").write_text(json.dumps(tj))
    from slimtune.models.tiny import build_model

    # with its weights: validate refuses a folder without them (it reads only their headers, loads nothing)
    build_model("llama", len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=1).save_pretrained(
        model_dir
    )
    data = tmp_path / "d.jsonl"
    data.write_text(json.dumps({"text": "hello world"}) + "\n")
    spec = tmp_path / "s.yaml"
    spec.write_text(
        f"name: t\nmodel: {{name_or_path: {model_dir}, device: cpu}}\ndata: {{path: {data}}}\n"
        f"output_dir: {tmp_path / 'out'}\nexport: {{gguf: [f16, q8_0]}}\n"
    )
    validate = [sys.executable, "-m", "slimtune.cli.main", "validate", str(spec)]
    # Both at once: each spends most of its ~12 s importing, on one core of the two.
    started = [
        subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for cmd in (validate, [*validate, "--set", "export.gguf_tokenizer=as_is"])
    ]
    outputs = [p.communicate(timeout=300) for p in started]
    done, as_is = [subprocess.CompletedProcess(p.args, p.returncode, *out) for p, out in zip(started, outputs)]
    assert done.returncode == 2, done.stderr
    assert "export.gguf" in done.stderr and "identical ids" in done.stderr
    assert "export.gguf_tokenizer: as_is" in done.stderr and "Lowercase" in done.stderr
    assert as_is.returncode == 0, as_is.stderr


def test_as_is_writes_the_closest_vocabulary_and_measures_the_mismatch(tmp_path):
    """export.gguf_tokenizer: as_is converts what exact refuses, and the check the report records says why and how
    often llama.cpp's ids differ."""
    from slimtune.export.gguf_tokenizer_check import check_tokenizer_export
    from slimtune.models.tiny import build_model, build_tokenizer

    model_dir = tmp_path / "m"
    tokenizer = build_tokenizer()
    tokenizer.save_pretrained(model_dir)
    tj = json.loads((model_dir / "tokenizer.json").read_text())
    tj["normalizer"] = {"type": "Lowercase"}
    (model_dir / "tokenizer.json").write_text(json.dumps(tj))
    build_model("llama", len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=1).save_pretrained(
        model_dir
    )
    [path] = convert_hf_to_gguf(model_dir, tmp_path / "m.gguf", "q8_0", tokenizer_as_is=True)
    assert read_header(path).kv["tokenizer.ggml.pre"] == "default"
    check = check_tokenizer_export(model_dir, strict=False)
    assert not check.exact and "Lowercase" in check.reasons[0]
    assert check.texts > 0 and 0 < check.mismatched <= check.texts  # the check texts have capitals
    assert check.mismatch_rate == check.mismatched / check.texts


def test_slimtune_run_exports_the_real_vocabulary_gemma4(runs):
    """As test_slimtune_run_exports_the_real_vocabulary, for Gemma 4's vocabulary (262k tokens, llama.cpp's own
    gemma4 tokenizer model)."""
    _check_exported_vocabulary("gemma-4", runs)
