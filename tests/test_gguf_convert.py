"""The GGUF converter without llama.cpp: every tensor read back with gguf's reader, metadata, tokenizer
mapping (and refusals), splitting, streaming memory, and transformers' own GGUF loader."""

from __future__ import annotations

import copy
import json
import re
import tracemalloc
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from slimtune.export import GGUF_METHODS, convert_hf_to_gguf, needs_llama_cpp, resolve_method
from slimtune.export.gguf_convert import _llama3_rope_factors
from slimtune.export.gguf_tokenizer import _tokens_and_types
from slimtune.export.llama_cpp_tokenizer import (
    _LLAMA3_REGEX,
    UnsupportedTokenizerError,
    pre_tokenizer_name,
    spm_scores,
    spm_space_prefix,
)
from slimtune.models.families import FAMILIES
from slimtune.models.tiny import BUILTIN_PREFIX, build_spm_tokenizer, ensure_builtin

Q = gguf.GGMLQuantizationType


@pytest.fixture(scope="module")
def tiny_dirs() -> dict[str, Path]:
    return {f: ensure_builtin(BUILTIN_PREFIX + f) for f in FAMILIES}  # built once, cached on disk


def _field(reader: gguf.GGUFReader, key: str):
    return reader.fields[key].contents()


def _deltanet_expected(key: str, w: np.ndarray, cfg: dict) -> tuple[str, np.ndarray]:
    """A Gated DeltaNet tensor as llama.cpp's qwen35 reads it (conversion/qwen.py): value heads from grouped by key
    head to tiled, A = -exp(A_log), dt_bias as ssm_dt's bias, conv1d squeezed, the gated norm without offset."""
    nk, nv, dv = cfg["linear_num_key_heads"], cfg["linear_num_value_heads"], cfg["linear_value_head_dim"]
    qk = 2 * nk * cfg["linear_key_head_dim"]
    per = nv // nk
    # tiled position j = v * nk + k holds grouped head k * per + v
    heads = [k * per + v for v in range(per) for k in range(nk)]

    def rows(head_dim: int) -> list[int]:
        return [h * head_dim + i for h in heads for i in range(head_dim)]

    if key.endswith("conv1d.weight"):
        w = w[:, 0, :]
    if key.endswith(("in_proj_qkv.weight", "conv1d.weight")):
        w = np.concatenate([w[:qk], w[qk:][rows(dv)]])
    elif key.endswith("in_proj_z.weight"):
        w = w[rows(dv)]
    elif key.endswith(("in_proj_a.weight", "in_proj_b.weight", "A_log", "dt_bias")):
        w = w[rows(1)]
    elif key.endswith("out_proj.weight"):
        w = w[:, rows(dv)]
    if key.endswith("A_log"):
        w = -np.exp(w)
    return key.replace(".dt_bias", ".dt_proj.bias"), w


def _expected_gguf_tensors(model_dir: Path, family: str) -> dict[str, np.ndarray]:
    """HF tensors under their GGUF names, with the layout changes llama.cpp needs applied independently."""
    cfg = json.loads((model_dir / "config.json").read_text())
    row = FAMILIES[family]
    name_map = gguf.get_tensor_name_map(row.gguf_arch, cfg["num_hidden_layers"])
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    out = {}
    experts: dict[str, dict[int, np.ndarray]] = {}  # an MoE's per-expert tensors, stacked by expert below
    for key, t in load_file(model_dir / "model.safetensors").items():
        w = t.float().numpy()
        if m := re.fullmatch(r"(.+\.experts)\.(\d+)\.(.+)", key):
            experts.setdefault(f"{m[1]}.{m[3]}", {})[int(m[2])] = w
            continue
        if m := re.fullmatch(r"(.+\.experts)\.(gate_up_proj|down_proj)(_bias)?", key):  # gpt-oss's fused experts
            # [E, in, out] for x @ W, gate and up interleaved by column -> llama.cpp's gate/up/down [E, out, in]
            halves = {"down_proj": w} if m[2] == "down_proj" else {"gate_proj": w[..., 0::2], "up_proj": w[..., 1::2]}
            for proj, part in halves.items():
                hf = f"{m[1]}.{proj}{'.bias' if m[3] else '.weight'}"
                out[name_map.get_name(hf, try_suffixes=(".weight", ".bias"))] = part if m[3] else part.swapaxes(1, 2)
            continue
        if row.permute_qk and ("q_proj" in key or "k_proj" in key):
            # rows of head h: HF [x_0..x_31, y_0..y_31] -> llama.cpp [x_0, y_0, x_1, y_1, ...]
            heads = w.shape[0] // head_dim
            order = [
                h * head_dim + half * head_dim // 2 + i
                for h in range(heads)
                for i in range(head_dim // 2)
                for half in (0, 1)
            ]
            w = w[order]
        if ".linear_attn." in key:  # Qwen3.5's Gated DeltaNet: its own layout
            key, w = _deltanet_expected(key, w, cfg)
            out[name_map.get_name(key, try_suffixes=(".weight", ".bias"))] = w  # A_log's ssm_a stays bare
            continue
        if row.norm_offset and key.endswith("norm.weight"):  # Gemma's (1 + w) norms
            w = w + 1.0
        name = name_map.get_name(key, try_suffixes=(".weight", ".bias"))
        out[name if name.endswith((".weight", ".bias")) else f"{name}.weight"] = w  # Gemma 4's bare layer_scalar
    for key, members in experts.items():  # llama.cpp's ffn_*_exps: experts along the slowest dimension
        out[name_map.get_name(key, try_suffixes=(".weight",))] = np.stack([members[i] for i in sorted(members)])
    if family == "gemma4_text":  # its global layers rotate 1/4 of the 128-wide head: 16 of 64 pairs, 48 stopped
        out["rope_freqs.weight"] = np.array([1.0] * 16 + [1e30] * 48, dtype=np.float32)
    return out


def test_method_names_resolve():
    assert resolve_method("not_quantized") == "f16"
    assert resolve_method("fast_quantized") == "q8_0"
    assert resolve_method(" Quantized ") == "q4_k_m"
    assert resolve_method("Q5_K_M") == "q5_k_m"
    assert not needs_llama_cpp("fast_quantized") and not needs_llama_cpp("q4_0")
    assert needs_llama_cpp("quantized") and needs_llama_cpp("iq4_xs")
    assert {"q2_k", "q3_k_s", "q3_k_l", "q4_k_s", "q5_k_s", "q6_k", "iq4_nl", "bf16"} <= set(GGUF_METHODS)
    with pytest.raises(ValueError, match="choose one of"):
        resolve_method("q7_k")


@pytest.mark.parametrize("family", FAMILIES)
def test_every_tensor_round_trips(tiny_dirs, tmp_path, family):
    model_dir = tiny_dirs[family]
    [path] = convert_hf_to_gguf(model_dir, tmp_path / f"{family}.gguf", "f32")
    assert [p.name for p in tmp_path.iterdir()] == [f"{family}.gguf"]  # the temporary was renamed
    reader = gguf.GGUFReader(path)
    expected = _expected_gguf_tensors(model_dir, family)
    got = {t.name: t for t in reader.tensors}
    assert set(got) == set(expected), set(got) ^ set(expected)
    for name, want in expected.items():
        t = got[name]
        assert t.tensor_type == Q.F32
        np.testing.assert_array_equal(np.asarray(t.data).reshape(want.shape), want, err_msg=name)

    arch = _field(reader, "general.architecture")
    renamed = {"mistral": "llama", "gemma3_text": "gemma3", "gemma4_text": "gemma4", "qwen3_5_text": "qwen35"}
    renamed |= {"qwen3_moe": "qwen3moe", "gpt_oss": "gpt-oss"}
    assert arch == renamed.get(family, family)
    assert _field(reader, f"{arch}.attention.head_count") == 4
    assert _field(reader, f"{arch}.attention.head_count_kv") == 2
    # Gemma 4: key_length is the global layers' head, key_length_swa the sliding layers'
    assert _field(reader, f"{arch}.attention.key_length") == (128 if family == "gemma4_text" else 64)
    cfg = json.loads((model_dir / "config.json").read_text())
    assert _field(reader, f"{arch}.block_count") == cfg["num_hidden_layers"]
    assert _field(reader, "general.file_type") == int(gguf.LlamaFileType.ALL_F32)
    tok = json.loads((model_dir / "tokenizer.json").read_text())
    tokens = _field(reader, "tokenizer.ggml.tokens")
    assert len(tokens) == 869 and all(tokens[i] == t for t, i in tok["model"]["vocab"].items())
    # transformers 5 loads a qwen2 checkpoint's tokenizer as Qwen2Tokenizer, which swaps in Qwen2's split
    # regex and NFC whatever tokenizer.json says; the GGUF follows what transformers actually runs
    assert _field(reader, "tokenizer.ggml.pre") == ("qwen2" if family == "qwen2" else "gpt-2")
    assert _field(reader, "tokenizer.ggml.merges")[:2] == [" ".join(m) for m in tok["model"]["merges"][:2]]
    assert _field(reader, "tokenizer.ggml.token_type")[:3] == [int(gguf.TokenType.CONTROL)] * 3
    assert _field(reader, "tokenizer.ggml.eos_token_id") == tokens.index("<|im_end|>")
    assert _field(reader, "tokenizer.ggml.padding_token_id") == tokens.index("<|endoftext|>")
    assert "tokenizer.ggml.bos_token_id" not in reader.fields  # the tiny tokenizer has none
    assert _field(reader, "tokenizer.ggml.add_bos_token") is False
    assert "<|im_start|>" in _field(reader, "tokenizer.chat_template")


def test_sharded_checkpoint_converts(tiny_dirs, tmp_path):
    """Merged models arrive as several safetensors files plus an index; all their tensors must arrive."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(tiny_dirs["qwen2"], dtype=torch.float32)
    model.save_pretrained(tmp_path / "m", max_shard_size="3MB")
    AutoTokenizer.from_pretrained(tiny_dirs["qwen2"]).save_pretrained(tmp_path / "m")
    assert len(list((tmp_path / "m").glob("*.safetensors"))) >= 3
    [path] = convert_hf_to_gguf(tmp_path / "m", tmp_path / "q.gguf", "f32")
    expected = _expected_gguf_tensors(tiny_dirs["qwen2"], "qwen2")
    got = {t.name: np.asarray(t.data) for t in gguf.GGUFReader(path).tensors}
    assert set(got) == set(expected)
    assert all(np.array_equal(got[k].reshape(v.shape), v) for k, v in expected.items())


@pytest.mark.parametrize(
    "out_type,qtype,tol",
    [
        ("f16", Q.F16, 1e-3),  # 11 bits of mantissa: relative error <= 2^-11 (tolerances are relative to amax)
        ("bf16", Q.BF16, 8e-3),  # 8 bits of mantissa: relative error <= 2^-8
        ("q8_0", Q.Q8_0, 8e-3),  # per-32 block scale amax/127: error <= amax/254
        ("q5_0", Q.Q5_0, 7e-2),  # 16 levels per sign: error <= amax/32
        ("q4_0", Q.Q4_0, 1.3e-1),  # 8 levels per sign: error <= amax/16
    ],
)
def test_quantized_types_dequantize_close(tiny_dirs, tmp_path, out_type, qtype, tol):
    [path] = convert_hf_to_gguf(tiny_dirs["llama"], tmp_path / f"llama-{out_type}.gguf", out_type)
    expected = _expected_gguf_tensors(tiny_dirs["llama"], "llama")
    for t in gguf.GGUFReader(path).tensors:
        want = expected[t.name]
        if want.ndim == 1:
            assert t.tensor_type == Q.F32, t.name  # norms stay f32
            continue
        lowbit_output = t.name == "output.weight" and qtype in (Q.Q4_0, Q.Q5_0)
        assert t.tensor_type == (Q.Q8_0 if lowbit_output else qtype), t.name
        got = gguf.quants.dequantize(np.asarray(t.data), t.tensor_type).reshape(want.shape)
        rel = np.abs(got - want).max() / np.abs(want).max()
        assert 0 < rel <= tol, (t.name, rel)


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_transformers_gguf_loader_reproduces_hf_logits(tiny_dirs, tmp_path, family):
    """transformers undoes the Q/K permutation itself, so exact logits prove the layout and hparams.

    (Not qwen3: transformers 5.23's GGUF config map ignores attention.key_length, so it rebuilds Qwen3
    with head_dim 128 instead of 64; gemma is not in its GGUF architectures at all.)
    """
    from transformers import AutoModelForCausalLM

    [path] = convert_hf_to_gguf(tiny_dirs[family], tmp_path / "m.gguf", "f32")
    ours = AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file=path.name, dtype=torch.float32)
    ref = AutoModelForCausalLM.from_pretrained(tiny_dirs[family], dtype=torch.float32)
    ids = torch.arange(3, 60)[None]
    with torch.no_grad():
        diff = (ours(ids).logits - ref(ids).logits).abs().max().item()
    assert diff < 1e-5  # same f32 weights, same kernels: only op-order noise


def test_split_writes_gguf_split_shards(tiny_dirs, tmp_path):
    out = tmp_path / "out" / "llama.gguf"
    paths = convert_hf_to_gguf(tiny_dirs["llama"], out, "f16", split_max_bytes=1_500_000)
    n = len(paths)
    assert n >= 3
    assert [p.name for p in paths] == [f"llama-{i:05d}-of-{n:05d}.gguf" for i in range(1, n + 1)]
    assert sorted(p.name for p in out.parent.iterdir()) == [p.name for p in paths]  # no temp leftovers
    names = []
    for i, p in enumerate(paths):
        reader = gguf.GGUFReader(p)
        assert _field(reader, "split.no") == i and _field(reader, "split.count") == n
        assert sum(t.n_bytes for t in reader.tensors) <= 1_500_000 or len(reader.tensors) == 1
        names += [t.name for t in reader.tensors]
    assert set(names) == set(_expected_gguf_tensors(tiny_dirs["llama"], "llama"))
    assert _field(gguf.GGUFReader(paths[0]), "split.tensors.count") == len(names)


def test_conversion_streams_one_tensor_at_a_time(tiny_dirs, tmp_path):
    model_bytes = (tiny_dirs["llama"] / "model.safetensors").stat().st_size  # 11 MB of f32
    largest = 869 * 256 * 4  # token_embd / output: 0.9 MB
    tracemalloc.start()
    try:
        convert_hf_to_gguf(tiny_dirs["llama"], tmp_path / "m.gguf", "q8_0")
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    # numpy reports its buffers to tracemalloc; holding the model would exceed 11 MB
    assert peak < 4 * largest < model_bytes / 2, peak


def test_llama3_rope_factors_match_transformers():
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    rope = {
        "rope_type": "llama3",
        "rope_theta": 500000.0,
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
    }
    cfg = LlamaConfig(hidden_size=256, num_attention_heads=4, head_dim=64, rope_parameters=rope)
    scaled, _ = ROPE_INIT_FUNCTIONS["llama3"](cfg, "cpu")
    base = 1.0 / 500000.0 ** (torch.arange(0, 64, 2, dtype=torch.float64) / 64)
    factors = _llama3_rope_factors(cfg.to_dict())
    assert 1.0 in factors and 8.0 in factors and ((factors > 1) & (factors < 8)).any()  # all three regimes
    np.testing.assert_allclose(base.numpy() / factors, scaled.numpy(), rtol=1e-6)


def test_unknown_architecture_and_rope_are_refused(tiny_dirs, tmp_path):
    import shutil

    model_dir = shutil.copytree(tiny_dirs["llama"], tmp_path / "m")
    cfg = json.loads((model_dir / "config.json").read_text())
    (model_dir / "config.json").write_text(json.dumps({**cfg, "architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(ValueError, match="GPT2LMHeadModel.*supported: LlamaForCausalLM"):
        convert_hf_to_gguf(model_dir, tmp_path / "a.gguf")
    rope = {"rope_type": "dynamic", "rope_theta": 1e4, "factor": 2.0}
    (model_dir / "config.json").write_text(json.dumps({**cfg, "rope_parameters": rope}))
    with pytest.raises(ValueError, match="'dynamic' is not supported"):
        convert_hf_to_gguf(model_dir, tmp_path / "b.gguf")
    rope = {"rope_type": "longrope", "rope_theta": 1e4, "long_factor": [1.0] * 32, "short_factor": [1.0] * 32}
    (model_dir / "config.json").write_text(json.dumps({**cfg, "rope_parameters": rope}))
    with pytest.raises(ValueError, match="longrope scaling on llama, whose llama.cpp architecture has no rope factor"):
        convert_hf_to_gguf(model_dir, tmp_path / "b.gguf")
    rope = {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0, "beta_fast": 16.0}
    (model_dir / "config.json").write_text(json.dumps({**cfg, "rope_parameters": rope}))
    with pytest.raises(ValueError, match="yarn rope scaling with {'beta_fast': 16.0}"):
        convert_hf_to_gguf(model_dir, tmp_path / "c.gguf")
    assert not list(tmp_path.glob("*.gguf")) and not list(tmp_path.glob(".*tmp"))


def test_pre_tokenizer_mapping_and_refusals(tiny_dirs):
    tj = json.loads((tiny_dirs["llama"] / "tokenizer.json").read_text())
    assert pre_tokenizer_name(tj) == "gpt-2"

    def variant(path: str, value) -> dict:
        t = copy.deepcopy(tj)
        *parents, leaf = path.split(".")
        node = t
        for p in parents:
            node = node[p]
        node[leaf] = value
        return t

    refused = {
        "pre_tokenizer": {"type": "Whitespace"},
        "pre_tokenizer.add_prefix_space": True,
        "pre_tokenizer.use_regex": False,
        "normalizer": {"type": "Lowercase"},
        "model.ignore_merges": True,
        "model.byte_fallback": True,
        "model.type": "Unigram",
        "decoder": {"type": "Metaspace"},
    }
    for path, value in refused.items():
        with pytest.raises(UnsupportedTokenizerError):
            pre_tokenizer_name(variant(path, value))
    split = {
        "type": "Sequence",
        "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": _LLAMA3_REGEX}, "behavior": "Isolated", "invert": False},
            {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False},
        ],
    }
    assert pre_tokenizer_name(variant("model.ignore_merges", True) | {"pre_tokenizer": split}) == "llama-bpe"
    # llama.cpp's llama-bpe ignores merges; its twin smaug-bpe (the same regex) does not
    assert pre_tokenizer_name(tj | {"pre_tokenizer": split}) == "smaug-bpe"


def test_spm_tokenizer_shapes_and_refusals():
    """SentencePiece-style tokenizers: which text preparation maps to llama.cpp's add_space_prefix, and what is
    refused because llama.cpp's SPM vocabulary would tokenize differently (ids are checked in llama.cpp in
    test_gguf_quant_verify)."""
    llama2 = json.loads(build_spm_tokenizer("llama2").backend_tokenizer.to_str())
    gemma = json.loads(build_spm_tokenizer("gemma").backend_tokenizer.to_str())
    assert spm_space_prefix(llama2) is True and spm_space_prefix(gemma) is False
    first = copy.deepcopy(llama2)
    first["pre_tokenizer"]["prepend_scheme"] = "first"  # what transformers builds for legacy=False and from a GGUF
    assert spm_space_prefix(first) is True  # differs after special tokens only (documented, as sentencepiece does)
    split = copy.deepcopy(llama2)
    split["pre_tokenizer"]["split"] = True  # words split at spaces: llama.cpp merges across them
    with pytest.raises(UnsupportedTokenizerError, match="is not how llama.cpp's SPM tokenizer"):
        spm_space_prefix(split)
    with pytest.raises(UnsupportedTokenizerError, match="Unigram"):
        spm_space_prefix({**gemma, "model": {**gemma["model"], "type": "Unigram"}})

    tokens, types = _tokens_and_types(gemma, len(gemma["model"]["vocab"]) + 64, "t")
    assert types.count(int(gguf.TokenType.BYTE)) == 256 and types.count(int(gguf.TokenType.UNKNOWN)) == 1
    scores = spm_scores(gemma, tokens, types, "t")
    merges = [tuple(m) if isinstance(m, list) else tuple(m.split(" ")) for m in gemma["model"]["merges"]]
    for rank, (left, right) in enumerate(merges[:50]):  # a later merge never outranks an earlier token's
        assert scores[tokens.index(left + right)] >= -rank
    dropped = copy.deepcopy(gemma)
    dropped["model"]["merges"] = gemma["model"]["merges"][:10] + gemma["model"]["merges"][11:]
    with pytest.raises(UnsupportedTokenizerError, match="is not a merge"):
        spm_scores(dropped, tokens, types, "t")
    swapped = copy.deepcopy(gemma)
    order = gemma["model"]["merges"]
    target = [i for i in range(1, len(merges)) if "".join(merges[i]) == "".join(merges[i - 1])][0]
    moved = [order[target], order[target + 1], order[target - 1]]  # one of the token's merges moved past another's
    swapped["model"]["merges"] = order[: target - 1] + moved + order[target + 2 :]
    tied = spm_scores(swapped, tokens, types, "t")  # interleaved merges: equal scores, as generate_merges' ties
    joined = ["".join(merges[i]) for i in (target, target + 1)]
    assert tied[tokens.index(joined[0])] == tied[tokens.index(joined[1])] == -(target - 1)
    no_bytes = copy.deepcopy(gemma)
    del no_bytes["model"]["vocab"]["<0x41>"]
    with pytest.raises(UnsupportedTokenizerError, match="without the byte tokens <0x41>"):
        _tokens_and_types(no_bytes, 2048, "t")
