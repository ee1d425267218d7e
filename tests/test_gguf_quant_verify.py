"""GGUF files checked by their real consumer, llama.cpp (llama-cpp-python): logits against HF, tokenizer
ids against HF, k-quants, q8_0 bytes against llama.cpp's own quantizer, split files, and broken files."""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf_checks import PROMPTS, argmax_agreement
from gguf_held_weights import GgmlActivations, dequantized_tensors, held_weights_checkpoint

from slimtune.export import GGUFVerifyError, convert_hf_to_gguf, gguf_quantize, quantize_gguf, verify_gguf
from slimtune.export.gguf_verify import llama_cpp_logits, llama_cpp_tokenize, load_llama
from slimtune.export.llama_cpp_tokenizer import _LLAMA3_REGEX, _QWEN2_REGEX
from slimtune.models.families import FAMILIES
from slimtune.models.tiny import (
    BUILTIN_PREFIX,
    SPM_STYLES,
    build_model,
    build_spm_tokenizer,
    ensure_builtin,
    ensure_pretrained,
    save_tiny,
)

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
    # leaves 2-3e-4, the rest of ggml's fused GeGLU), so those are held to 1e-3. Gemma 4 runs a second GELU per
    # layer (the per-layer input gate) whose output multiplies the per-layer input: 0.026 measured, 0.0020 with
    # the fp16 table emulated in HF (tests/test_family_gemma4.py does); held to 0.05, where rotating its global
    # heads whole measured 0.24
    if family == "gemma4_text":
        return 0.05
    return 1e-3 if "gelu" in str(FAMILIES[family].tiny.get("hidden_activation")) else 1e-4


@pytest.mark.parametrize("family", FAMILIES)
def test_f32_gguf_logits_match_hf(llama_cpp, tiny, ggufs, family):
    report = verify_gguf(ggufs(family, "f32"), tiny[family], PROMPTS)
    assert report["token_ids_equal"], report
    assert report["max_abs_logit_diff"] < _f32_tolerance(family), report
    assert report["argmax_agreement"] == 1.0
    assert report["positions"] > 60
    json.dumps(report)  # goes into the run report as is


# The tokenizer each family's released checkpoints ship: SentencePiece style for the Gemmas, Mistral v0.1 and
# Phi-3-mini (Llama 2's), byte-level BPE for Llama 3, Qwen, Granite and OLMo 2 (Phi-4-mini's gpt-4o BPE is
# byte-level too); "llama-2" is the llama architecture with Llama 2's tokenizer.
_SPM_STYLE = {
    "gemma": "gemma",
    "gemma2": "gemma",
    "gemma3_text": "gemma",
    "gemma4_text": "gemma",  # written as llama.cpp's own "gemma4" vocabulary
    "mistral": "llama2",
    "phi3": "llama2",
}
CASES = [*FAMILIES, "llama-2"]


def _pretrained(case: str) -> Path:
    """The case's tiny model after a few optimizer steps (slimtune.models.tiny.pretrain says why), cached on disk."""
    family, style = ("llama", "llama2") if case == "llama-2" else (case, _SPM_STYLE.get(case, "bpe"))
    return ensure_pretrained(family, style)


def _logits(path: Path, model_dir: Path) -> list[tuple[np.ndarray, np.ndarray]]:
    """(fp32 HF logits, the GGUF's logits in llama.cpp) for each of the verification prompts."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    llm = load_llama(path)
    out = []
    with torch.no_grad():
        for prompt in PROMPTS:
            ids = tokenizer(prompt)["input_ids"]
            out.append((model(torch.tensor([ids])).logits[0].numpy(), llama_cpp_logits(llm, ids)))
    llm.close()
    return out


def _flips(pairs: list[tuple[np.ndarray, np.ndarray]]) -> list[tuple[float, float]]:
    """(HF's top-2 logit gap, llama.cpp's largest logit error there) at each position where the GGUF picks
    another next token than the fp32 HF model."""
    out = []
    for ref, got in pairs:
        top2 = np.sort(ref, axis=-1)[:, -2:]
        for i in np.flatnonzero(got.argmax(-1) != ref.argmax(-1)):
            out.append((float(top2[i, 1] - top2[i, 0]), float(np.abs(got[i] - ref[i]).max())))
    return out


@pytest.mark.parametrize("case", CASES)
def test_f16_gguf_matches_hf_at_every_position(llama_cpp, tmp_path, case):
    """Every family's f16 file: llama.cpp's token ids are HF's (byte-level BPE or SentencePiece style) and it
    picks HF's next token at every position (gemma's +1 norms, Gemma 2 soft-capping, sliding windows, Phi-3's
    fused projections, Granite's multipliers and OLMo 2's post-norms all survive f16)."""
    model_dir = _pretrained(case)
    [path] = convert_hf_to_gguf(model_dir, tmp_path / f"{case}-f16.gguf", "f16")
    report = verify_gguf(path, model_dir, PROMPTS)
    assert report["token_ids_equal"] and report["positions"] > 150, report
    # f16 rounds weights and activations at 2^-11: where HF's best two logits are closer than twice the file's
    # own logit error at that position, either order is right to f16 precision. Measured: 1 such position in
    # the ~2000 of all cases (llama, prompt 3: gap 0.008, error 0.010), and 2 of 180 on one gpt-oss pretraining
    # (2026-11-27, gaps 0.0010 and 0.0013); every other position agrees.
    pairs = _logits(path, model_dir) if case == "gpt_oss" or report["argmax_agreement"] < 1.0 else []
    flips = _flips(pairs)
    assert all(gap < 2 * err for gap, err in flips) and len(flips) <= max(2, 0.01 * report["positions"]), flips
    # f16 weights round at 2^-11 relative; after pretraining the logits reach ~10-20 and errors measured up
    # to 0.19 (mistral); a conversion mistake moves logits by whole units, at most positions.
    assert 1e-7 < report["max_abs_logit_diff"], report
    if case != "gpt_oss":
        assert report["max_abs_logit_diff"] < 0.5, report
        return
    # gpt-oss's tiny moves a few isolated positions by whole units on some pretrainings (why is not known: its
    # weights rounded to f16 in transformers move its logits by 0.03 at most), every other within f16 rounding. Its
    # largest error was 0.011, 0.020, 0.093 and 0.85 on four pretrainings (2026-11-27), and 4.20 on one of
    # 2026-11-28, at 2 of 180 positions above 0.5, 95% of them within 0.025 (another that day: 0.016 at most).
    # Held: few such positions, the rest within f16 rounding; a conversion mistake moves most of them.
    errors = np.concatenate([np.abs(got - ref).max(-1) for ref, got in pairs])
    assert (errors > 0.5).sum() <= max(2, 0.01 * errors.size) and np.percentile(errors, 95) < 0.1, errors


@pytest.mark.parametrize("case", CASES)
def test_q8_0_gguf_picks_hf_next_token(llama_cpp, tmp_path, case):
    """q8_0 against the fp32 HF model: the same next token at >= 98% of all positions, or at >= 97% where every
    other position is a near-tie q8_0 may order either way."""
    model_dir = _pretrained(case)
    [path] = convert_hf_to_gguf(model_dir, tmp_path / f"{case}-q8_0.gguf", "q8_0")
    report = verify_gguf(path, model_dir, PROMPTS)
    assert report["token_ids_equal"], report
    # Measured 2026-11-26: the mistral and llama-2 models pretrained on this machine agree at 181 of 185
    # positions (97.8%; 98.3-100% before, on another machine's pretraining), the same with the code of then.
    # As for f16, a flip counts as a near-tie where HF's best two logits are closer than twice the file's own
    # logit error there; a conversion mistake flips positions with wide gaps.
    # Qwen3.5's DeltaNet layers carry each position's rounding into every later one through their recurrent
    # state (gates from 8-bit in_proj_a/b): measured 2026-11-26, 174 of 180 positions (96.7%), every flip a
    # near-tie (largest logit error 0.98), while its f16 file agrees at every position; llama.cpp's quantizer writes
    # the same bytes, and transformers with the weights rounded to q8_0 agrees at 177 (2026-11-27).
    # gpt-oss: measured 2026-11-27 on four pretrainings of its tiny: 170 to 178 of 180 positions (94.4-98.9%), every
    # flip a near-tie by the rule below, largest logit errors 1.0-2.9 (its f16 files: 0.011-0.85). The errors
    # are the 8-bit weights' own: transformers with the weights rounded to q8_0 makes them too (on one: attention alone
    # 5.8, token embeddings 2.9, experts 0.03), and llama.cpp's quantizer writes the same bytes. Keeping the router f32,
    # as llama.cpp does, moved three pretrainings from 176, 176, 176 to 178, 174, 175 of 180: routing is not the cause.
    # qwen3_moe: 174 of 180 (96.7%) on an AVX-512 machine's pretraining (2026-11-27), every flip a near-tie.
    floor = {"qwen3_5_text": 0.96, "gpt_oss": 0.93, "qwen3_moe": 0.96}.get(case, 0.97)
    flips = [] if report["argmax_agreement"] >= 0.98 else _flips(_logits(path, model_dir))
    assert report["argmax_agreement"] >= floor and all(gap < 2 * err for gap, err in flips), (report, flips)
    assert report["max_abs_logit_diff"] > 1e-3, report  # 8-bit weights really moved the logits


@pytest.mark.parametrize("case", CASES)
def test_q8_0_gguf_picks_next_token_of_the_weights_it_holds(llama_cpp, tmp_path, case):
    """q8_0 against transformers running the weights the file holds (every quantized tensor dequantized), its
    activations rounded as llama.cpp's q8_0 products round them: the rounding that flips near-ties against fp32 above
    is shared, so the same next token at >= 98% of all positions in every family, with no near-tie allowance."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model_dir = _pretrained(case)
    [path] = convert_hf_to_gguf(model_dir, tmp_path / f"{case}-q8_0.gguf", "q8_0")
    held, types = held_weights_checkpoint(model_dir, path, tmp_path / "held")
    # the reference holds exactly the file's weights: converted to f32, every tensor is the file's, dequantized
    [check] = convert_hf_to_gguf(held, tmp_path / "held-f32.gguf", "f32")
    ours, file = dequantized_tensors(check), dequantized_tensors(path)
    assert ours.keys() == file.keys() and all(np.array_equal(ours[n][1], v) for n, (_, v) in file.items())
    assert Q.Q8_0 in types.values()
    reference = AutoModelForCausalLM.from_pretrained(held, dtype=torch.float32).eval()
    llm = load_llama(path)
    with GgmlActivations(reference, types):
        agreement = argmax_agreement(llm, reference, AutoTokenizer.from_pretrained(model_dir))
    llm.close()
    # Measured 2026-11-27: every position in every case but gemma3_text and gemma4_text, 182 of 183 (ggml's GELU reads
    # an fp16 table, see _f32_tolerance). Without the activation rounding 176 of 180 (qwen3_moe) up to every position.
    assert agreement >= 0.98, agreement


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
    agreement = argmax_agreement(llm, reference, AutoTokenizer.from_pretrained(tiny[family]))
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
    row = FAMILIES[family]
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
    agreement = argmax_agreement(
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

    from slimtune.models.tiny import SPECIAL_TOKENS, _corpus

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


# Beyond TEXTS: text starting with newlines, long digit runs, and characters SentencePiece-style vocabularies
# spell with <0xNN> byte tokens (accents, CJK, emoji) next to ones they know.
SPM_TEXTS = [
    "\n\nstarts with newlines",
    "digits 0123456789 9876543210",
    "emoji🙂inside, ümlaut at the end ü",
    "<|im_start|>user\nnaïve café? 中文<|im_end|>\n",
]


def _spm_model(tmp_path: Path, tokenizer) -> Path:
    build_model("llama", len(tokenizer), num_hidden_layers=1).save_pretrained(tmp_path / "m")
    tokenizer.save_pretrained(tmp_path / "m")
    [path] = convert_hf_to_gguf(tmp_path / "m", tmp_path / "m.gguf", "f16")
    return path


@pytest.mark.parametrize("style", SPM_STYLES)
def test_spm_tokenizers_give_hf_ids_in_llama_cpp(llama_cpp, tmp_path, style):
    """Llama 2 / Gemma style tokenizers as transformers 5 loads them (LlamaTokenizer legacy=True, GemmaTokenizer),
    written as llama.cpp's SPM vocabulary: the same ids, byte fallback included."""
    from transformers import AutoTokenizer

    path = _spm_model(tmp_path, build_spm_tokenizer(style))
    fields = gguf.GGUFReader(path).fields
    assert fields["tokenizer.ggml.model"].contents() == "llama"
    assert fields["tokenizer.ggml.add_space_prefix"].contents() == (style == "llama2")
    hf = AutoTokenizer.from_pretrained(tmp_path / "m")
    byte_ids = {hf.convert_tokens_to_ids(f"<0x{b:02X}>") for b in range(256)}
    assert set(hf("🙂")["input_ids"]) & byte_ids  # the emoji really takes the byte fallback
    space = hf.convert_tokens_to_ids("\u2581")
    llm = llama_cpp.Llama(str(path), vocab_only=True, verbose=False)
    for text in TEXTS + SPM_TEXTS:
        expected = hf(text)["input_ids"]
        if style == "llama2" and text.startswith(" "):
            # the documented difference (llama_cpp_tokenizer.spm_space_prefix): llama.cpp puts its "▁" in front of
            # text that already starts with a space, transformers' Metaspace does not
            expected = expected[:1] + [space] + expected[1:]
        assert llama_cpp_tokenize(llm, text) == expected, text
    llm.close()


def test_llama2_tokenizer_json_normalizers_give_identical_ids(llama_cpp, tmp_path):
    """The tokenizer.json form of Llama 2 (Prepend + Replace normalizers, no pre-tokenizer), loaded as is,
    matches llama.cpp everywhere, leading spaces included."""
    from tokenizers import normalizers
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    spm = build_spm_tokenizer("llama2")
    backend = spm.backend_tokenizer
    backend.normalizer = normalizers.Sequence([normalizers.Prepend("\u2581"), normalizers.Replace(" ", "\u2581")])
    backend.pre_tokenizer = None
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    path = _spm_model(tmp_path, tokenizer)
    hf = AutoTokenizer.from_pretrained(tmp_path / "m")
    llm = llama_cpp.Llama(str(path), vocab_only=True, verbose=False)
    for text in TEXTS + SPM_TEXTS:
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


@pytest.mark.parametrize("original", [16, 256], ids=["long_factor", "short_factor"])
def test_phi3_longrope_matches_hf_in_llama_cpp(llama_cpp, tmp_path, original):
    """Phi-3 128k / Phi-3.5 / Phi-4-mini longrope: every prompt is longer than 16 positions and shorter than
    256, so HF uses long_factor for the first and short_factor for the second, as llama.cpp does for a context
    above / below the original length (verify_gguf loads it with a context of the longest prompt, >= 64)."""
    import shutil

    n_freq = int(64 * 0.75) // 2  # the tiny phi3 rotates 3/4 of each 64-wide head
    rope = {
        "rope_type": "longrope",
        "rope_theta": 10000.0,
        "partial_rotary_factor": 0.75,
        "original_max_position_embeddings": original,
        "long_factor": np.linspace(1.0, 8.0, n_freq).tolist(),
        "short_factor": np.linspace(1.0, 1.5, n_freq).tolist(),
    }
    model_dir = save_tiny(tmp_path / "m", "phi3", rope_parameters=rope, original_max_position_embeddings=original)
    [path] = convert_hf_to_gguf(model_dir, tmp_path / "m.gguf", "f32")
    assert {"rope_factors_long.weight", "rope_factors_short.weight"} <= set(_tensor_types(path))
    report = verify_gguf(path, model_dir, PROMPTS)
    assert report["max_abs_logit_diff"] < 1e-4 and report["token_ids_equal"], report
    # the comparison can fail: the same weights without the scaling are far from this file
    plain = shutil.copytree(model_dir, tmp_path / "plain")
    config = json.loads((plain / "config.json").read_text())
    config["rope_parameters"] = {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.75}
    (plain / "config.json").write_text(json.dumps(config))
    assert verify_gguf(path, plain, PROMPTS[:1])["max_abs_logit_diff"] > 1e-3


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
