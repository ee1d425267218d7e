"""GGUF files checked by their real consumer, llama.cpp (llama-cpp-python): logits against HF, tokenizer
ids against HF, k-quants, q8_0 bytes against llama.cpp's own quantizer, split files, and broken files."""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from slimtune.export import GGUFVerifyError, convert_hf_to_gguf, gguf_quantize, quantize_gguf, verify_gguf
from slimtune.export.gguf_tokenizer import _LLAMA3_REGEX, _QWEN2_REGEX
from slimtune.export.gguf_verify import compare_logits, llama_cpp_logits, llama_cpp_tokenize, load_llama
from slimtune.families import FAMILIES as TABLE
from slimtune.tiny import BUILTIN_PREFIX, FAMILIES, build_model, ensure_builtin, save_tiny

Q = gguf.GGMLQuantizationType

# Special tokens, digits (runs longer than 3), punctuation, contractions in both cases, unicode (accents,
# CJK, emoji: bytes the tiny vocab never merged), leading/trailing/multiple spaces, tabs and newlines.
TEXTS = [
    "Hello world",
    " leading space and  two  spaces",
    "trailing spaces   ",
    "<|im_start|>user\nWhat is 12345 + 678?<|im_end|>\n<|im_start|>assistant\n",
    "don't DON'T we'll I'M you've",
    "Punctuation!!! (parens) [brackets] {braces}; a,b.c -- \"quotes\" 'single' ...",
    "café naïve Ünïcödé 中文字符 🙂👍",
    "tabs\tand\n\nnewlines\r\n and 3.14159 or 1,000,000",
    "<|endoftext|>text right after a special token<|im_end|>",
    "",
    "   ",
    "x",
]
PROMPTS = [
    "<|im_start|>user\nWrite a short poem about the sea.<|im_end|>\n<|im_start|>assistant\n",
    "The quick brown fox jumps over the lazy dog, then counts 1, 2, 3 and 45678 sheep.",
    "Explain gradient descent to a beginner in two sentences, with an example.",
    "def add(a, b):\n    return a + b  # numbers: 3.14, 2.71 — ünïcode too",
]


@pytest.fixture(scope="module")
def llama_cpp():
    return pytest.importorskip("llama_cpp")  # a guard only: CI installs slimtune[llama-cpp]


@pytest.fixture(scope="module")
def tiny() -> dict[str, Path]:
    return {f: ensure_builtin(BUILTIN_PREFIX + f) for f in FAMILIES}  # built once, cached on disk


@pytest.fixture(scope="module")
def ggufs(tiny, tmp_path_factory):
    """Converted files by (family, out_type), built on first use."""
    root = tmp_path_factory.mktemp("gguf")
    cache: dict[tuple[str, str], Path] = {}

    def get(family: str, out_type: str) -> Path:
        if (family, out_type) not in cache:
            [cache[family, out_type]] = convert_hf_to_gguf(tiny[family], root / f"{family}-{out_type}.gguf", out_type)
        return cache[family, out_type]

    return get


def _tensor_types(path: Path) -> dict[str, Q]:
    return {t.name: Q(t.tensor_type) for t in gguf.GGUFReader(path).tensors}


def _f32_tolerance(family: str) -> float:
    # f32 weights and f32 KV cache: op-order noise only (~1e-6), except where the MLP is GELU: ggml reads
    # GELU from an fp16 table (gemma2 measured 5.8e-4, gemma3_text 7.2e-4; emulating the table in HF
    # leaves 2-3e-4, the rest of ggml's fused GeGLU), so those are held to 1e-3
    return 1e-3 if "gelu" in str(TABLE[family].tiny.get("hidden_activation")) else 1e-4


@pytest.mark.parametrize("family", FAMILIES)
def test_f32_gguf_logits_match_hf(llama_cpp, tiny, ggufs, family):
    report = verify_gguf(ggufs(family, "f32"), tiny[family], PROMPTS)
    assert report["token_ids_equal"], report
    assert report["max_abs_logit_diff"] < _f32_tolerance(family), report
    assert report["argmax_agreement"] == 1.0
    assert report["positions"] > 60
    json.dumps(report)  # goes into the run report as is


def _agreement(llm, model_dir: Path, margin: float) -> tuple[float, float, float]:
    """(all positions, decisive positions, decisive share): argmax agreement of llama.cpp with the fp32 HF
    model, overall and where HF's best two logits are more than `margin` apart."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    same, clear = [], []
    with torch.no_grad():
        for prompt in PROMPTS:
            ids = tokenizer(prompt)["input_ids"]
            ref = model(torch.tensor([ids])).logits[0].numpy()
            same.append(llama_cpp_logits(llm, ids).argmax(-1) == ref.argmax(-1))
            top2 = np.sort(ref, axis=-1)[:, -2:]
            clear.append(top2[:, 1] - top2[:, 0] > margin)
    same, clear = np.concatenate(same), np.concatenate(clear)
    return float(same.mean()), float(same[clear].mean()), float(clear.mean())


# Random tiny models have many near-tied logits (median top-2 gap 0.03-0.08). Where HF's best two logits
# are closer than a file's logit error, the next token is a coin toss for that file, not a conversion
# error: f16 errors measured up to 2.1e-3 (gemma3_text), q8_0 up to 0.046 (gemma3_text).
_F16_MARGIN, _Q8_MARGIN = 0.01, 0.05


@pytest.mark.parametrize("family", FAMILIES)
def test_f16_gguf_logits_match_hf(llama_cpp, tiny, ggufs, family):
    """Every family's f16 file: llama.cpp's token ids are HF's, and it picks HF's next token at every
    position that is not a near tie (gemma's +1 norms, Gemma 2 soft-capping, sliding windows, Phi-3's
    fused projections, Granite's multipliers and OLMo 2's post-norms all survive f16)."""
    report = verify_gguf(ggufs(family, "f16"), tiny[family], PROMPTS)
    assert report["token_ids_equal"], report
    assert 1e-7 < report["max_abs_logit_diff"] < 1e-2, report  # f16 weights round at 2^-11 relative
    llm = load_llama(ggufs(family, "f16"))
    overall, decisive, share = _agreement(llm, tiny[family], _F16_MARGIN)
    llm.close()
    assert decisive == 1.0 and share > 0.8, (overall, decisive, share)
    assert overall >= 0.99, overall  # measured: 1.0 for every family but qwen3 (0.994, one near tie)


@pytest.mark.parametrize("family", FAMILIES)
def test_q8_0_gguf_picks_hf_next_token(llama_cpp, tiny, ggufs, family):
    """q8_0 against the fp32 HF model: at least 98% of the decisive positions agree, at least 93% of all."""
    llm = load_llama(ggufs(family, "q8_0"))
    overall, decisive, share = _agreement(llm, tiny[family], _Q8_MARGIN)
    llm.close()
    assert decisive >= 0.98 and share > 0.5, (family, overall, decisive, share)
    assert overall >= 0.93, (family, overall)


def _quantized_file(ggufs, tmp_path: Path, family: str, method: str) -> Path:
    if method in gguf_quantize.CONVERTER_TYPES:
        return ggufs(family, method)
    return quantize_gguf(ggufs(family, "f16"), tmp_path / f"{family}-{method}.gguf", method)


# The k-quant each method must really use somewhere (hidden 256 = one super-block per row).
_KQUANT_TYPE = {
    "q4_k_m": Q.Q4_K,
    "q5_k_m": Q.Q5_K,
    "q6_k": Q.Q6_K,
    "q3_k_m": Q.Q3_K,
    "q2_k": Q.Q2_K,
    "iq4_xs": Q.IQ4_XS,
}


def _argmax_agreement(llm, reference, tokenizer) -> float:
    agree, n = 0.0, 0
    with torch.no_grad():
        for prompt in PROMPTS:
            ids = tokenizer(prompt)["input_ids"]
            ref = reference(torch.tensor([ids])).logits[0].numpy()
            agree += compare_logits(llama_cpp_logits(llm, ids), ref)["argmax_agreement"] * len(ids)
            n += len(ids)
    return agree / n


@pytest.mark.parametrize(
    "family,method",
    [
        *[("llama", m) for m in ("q8_0", "q4_0", "q5_0", "q4_k_m", "q5_k_m", "q6_k")],
        ("mistral", "q4_0"),
        ("qwen2", "q5_k_m"),
        ("qwen2", "q8_0"),
    ],
)
def test_quantized_agrees_with_transformers_on_same_file(llama_cpp, tiny, ggufs, tmp_path, family, method):
    """transformers' GGUF loader dequantizes the same bytes, so both should pick the same next token
    almost everywhere; the rest is llama.cpp quantizing activations to 8 bits for its dot products.
    (Against the fp32 model, random tiny models have near-tied logits: q4_0 agrees on only ~70%.)"""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = _quantized_file(ggufs, tmp_path, family, method)
    if method in _KQUANT_TYPE:
        assert _KQUANT_TYPE[method] in _tensor_types(path).values()
    reference = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    llm = load_llama(path)
    agreement = _argmax_agreement(llm, reference, AutoTokenizer.from_pretrained(tiny[family]))
    llm.close()
    assert agreement >= 0.95, (family, method, agreement)


def _unpermute_rope_rows(w: np.ndarray, n_heads: int) -> np.ndarray:
    """llama.cpp's interleaved rope rows (x0, y0, x1, y1, ...) back to HF's halves, per head."""
    head_dim = w.shape[0] // n_heads
    return w.reshape(n_heads, head_dim // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _hf_with_gguf_weights(model_dir: Path, path: Path, family: str):
    """The HF model with every weight replaced by the GGUF's dequantized tensor, with the converter's
    layout changes undone; stands in for transformers' GGUF loader where it cannot load the file."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    cfg = model.config
    row = TABLE[family]
    name_map = gguf.get_tensor_name_map(row.gguf_arch, cfg.num_hidden_layers)
    tensors = {t.name: t for t in gguf.GGUFReader(path).tensors}
    state = {}
    for key, param in model.state_dict().items():
        if key == "lm_head.weight" and model.config.tie_word_embeddings:
            continue
        t = tensors[name_map.get_name(key, try_suffixes=(".weight", ".bias"))]
        w = gguf.quants.dequantize(np.asarray(t.data), Q(t.tensor_type)).reshape(param.shape)
        if row.norm_offset and key.endswith("norm.weight"):
            w = w - row.norm_offset
        elif row.permute_qk and key.endswith(("q_proj.weight", "k_proj.weight")):
            heads = cfg.num_attention_heads if "q_proj" in key else cfg.num_key_value_heads
            w = _unpermute_rope_rows(w, heads)
        state[key] = torch.tensor(w)  # a copy: F32 tensors are read-only views of the file
    model.load_state_dict(state, strict=False)
    return model


@pytest.mark.parametrize(
    "family,method", [("gemma", "q8_0"), ("gemma", "q4_0"), ("gemma", "q4_k_m"), ("gemma", "q6_k"), ("qwen3", "q5_k_m")]
)
def test_quantized_agrees_with_hf_on_dequantized_weights(llama_cpp, tiny, ggufs, tmp_path, family, method):
    """transformers 5.23 cannot load gemma GGUFs (not in its GGUF architectures) nor qwen3 ones with
    head_dim 64 (it ignores attention.key_length), so the reference is HF fp32 with the GGUF's
    dequantized weights (the un-permute path is exercised by llama in test_reference_builder_is_exact)."""
    from transformers import AutoTokenizer

    path = _quantized_file(ggufs, tmp_path, family, method)
    llm = load_llama(path)
    agreement = _argmax_agreement(
        llm, _hf_with_gguf_weights(tiny[family], path, family), AutoTokenizer.from_pretrained(tiny[family])
    )
    llm.close()
    assert agreement >= 0.95, (family, method, agreement)


def test_reference_builder_is_exact(tiny, ggufs):
    """_hf_with_gguf_weights on an f32 file must give back the HF model bit for bit."""
    from transformers import AutoModelForCausalLM

    rebuilt = _hf_with_gguf_weights(tiny["llama"], ggufs("llama", "f32"), "llama")
    original = AutoModelForCausalLM.from_pretrained(tiny["llama"], dtype=torch.float32)
    for (key, a), b in zip(rebuilt.state_dict().items(), original.state_dict().values()):
        assert torch.equal(a, b), key


def test_verify_report_on_a_quantized_file(llama_cpp, tiny, ggufs, tmp_path):
    report = verify_gguf(_quantized_file(ggufs, tmp_path, "qwen2", "q4_k_m"), tiny["qwen2"], PROMPTS)
    assert report["token_ids_equal"] and report["prompts"] == len(PROMPTS)
    assert 1e-3 < report["max_abs_logit_diff"] < 1.0, report  # 4-bit weights moved the logits, not wildly
    assert 0.5 < report["argmax_agreement"] <= 1.0, report


def test_llama_cpp_token_ids_equal_hf(llama_cpp, tiny, ggufs):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny["llama"])
    llm = llama_cpp.Llama(str(ggufs("llama", "f32")), vocab_only=True, verbose=False)
    for text in TEXTS:
        assert llama_cpp_tokenize(llm, text) == tokenizer(text)["input_ids"], text
    assert llama_cpp_tokenize(llm, "<|im_end|>") == [tokenizer.convert_tokens_to_ids("<|im_end|>")]
    llm.close()


@pytest.mark.parametrize(
    "regex,ignore_merges,expected_pre", [(_LLAMA3_REGEX, True, "llama-bpe"), (_QWEN2_REGEX, False, "qwen2")]
)
def test_split_regex_tokenizers_map_to_identical_llama_cpp_pre(llama_cpp, tmp_path, regex, ignore_merges, expected_pre):
    """Llama-3 / Qwen2 style tokenizers trained here, so the ids are checked without downloading theirs."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from slimtune.tiny import SPECIAL_TOKENS, _corpus

    tok = Tokenizer(models.BPE(ignore_merges=ignore_merges))
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(regex), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(
        _corpus(),
        trainers.BpeTrainer(
            vocab_size=700,
            special_tokens=SPECIAL_TOKENS,
            show_progress=False,
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        ),
    )
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    build_model("llama", len(hf), num_hidden_layers=1).save_pretrained(tmp_path / "m")
    hf.save_pretrained(tmp_path / "m")
    [path] = convert_hf_to_gguf(tmp_path / "m", tmp_path / "m.gguf", "f16")
    assert gguf.GGUFReader(path).fields["tokenizer.ggml.pre"].contents() == expected_pre
    llm = llama_cpp.Llama(str(path), vocab_only=True, verbose=False)
    for text in TEXTS:
        assert llama_cpp_tokenize(llm, text) == hf(text)["input_ids"], text
    llm.close()


def test_our_q8_0_bytes_equal_llama_cpp_quantizer(llama_cpp, ggufs, tmp_path):
    ours = {t.name: t for t in gguf.GGUFReader(ggufs("llama", "q8_0")).tensors}
    theirs_path = quantize_gguf(ggufs("llama", "f32"), tmp_path / "llama-q8_0-llamacpp.gguf", "q8_0")
    compared = 0
    for t in gguf.GGUFReader(theirs_path).tensors:
        if t.tensor_type == Q.Q8_0 and ours[t.name].tensor_type == Q.Q8_0:
            assert np.array_equal(np.asarray(t.data), np.asarray(ours[t.name].data)), t.name
            compared += 1
    assert compared == 4 * 7 + 2  # every linear of 4 layers, token_embd and output


def test_truncated_gguf_gives_a_clear_error(llama_cpp, tiny, ggufs, tmp_path):
    full = ggufs("llama", "f32").read_bytes()
    for keep in (len(full) - 100, len(full) // 2, 200):
        cut = tmp_path / f"cut-{keep}.gguf"
        cut.write_bytes(full[:keep])
        with pytest.raises(GGUFVerifyError, match=f"cut-{keep}.gguf .* is truncated or corrupt"):
            verify_gguf(cut, tiny["llama"], PROMPTS[:1])


def test_split_gguf_loads_in_llama_cpp(llama_cpp, tiny, tmp_path):
    paths = convert_hf_to_gguf(tiny["qwen2"], tmp_path / "q.gguf", "f32", split_max_bytes=2_000_000)
    assert len(paths) >= 4
    report = verify_gguf(paths[0], tiny["qwen2"], PROMPTS[:2])
    assert report["max_abs_logit_diff"] < 1e-4 and report["token_ids_equal"], report
    paths[-1].unlink()
    with pytest.raises(GGUFVerifyError, match="missing"):
        verify_gguf(paths[0], tiny["qwen2"], PROMPTS[:1])


@pytest.mark.parametrize(
    "rope",
    [
        {
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
        {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0},
        {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 512},
    ],
)
def test_rope_scaling_matches_hf_in_llama_cpp(llama_cpp, tmp_path, rope):
    family = "qwen2" if rope["rope_type"] == "yarn" else "llama"  # yarn is how Qwen2.5 extends context
    model_dir = save_tiny(tmp_path / "m", family, rope_parameters=rope)
    [path] = convert_hf_to_gguf(model_dir, tmp_path / "m.gguf", "f32")
    report = verify_gguf(path, model_dir, PROMPTS)
    assert report["max_abs_logit_diff"] < 1e-4, report


def test_quantize_without_the_extra_says_how_to_install(monkeypatch, tmp_path):
    monkeypatch.setattr(gguf_quantize, "llama_cpp_available", lambda: False)
    with pytest.raises(ImportError, match=r"slimtune\[llama-cpp\]"):
        quantize_gguf(tmp_path / "in.gguf", tmp_path / "out.gguf", "q4_k_m")
    with pytest.raises(ImportError, match=r"slimtune\[llama-cpp\]"):
        verify_gguf(tmp_path / "in.gguf", tmp_path, ["x"])


def test_failed_quantization_leaves_no_file(llama_cpp, tmp_path):
    bogus = tmp_path / "bogus.gguf"
    bogus.write_bytes(b"GGUF" + b"\0" * 64)
    with pytest.raises(RuntimeError, match="failed to quantize"):
        quantize_gguf(bogus, tmp_path / "out.gguf", "q4_k_m")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bogus.gguf"]
