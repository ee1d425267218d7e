"""The weights a GGUF file holds, as a Hugging Face checkpoint: a reference for llama.cpp that shares the file's
rounding, so that what is left between them is llama.cpp's own arithmetic.

Every tensor the converter quantizes reaches the file by rearranging checkpoint elements only (rope rows permuted,
experts stacked, gpt-oss's fused gate_up split by column and transposed, DeltaNet value heads tiled); only tensors
it keeps f32 are computed from them (Gemma's norm offset, -exp(A_log)). Converting a checkpoint whose every element
holds its own index therefore says where each element of each quantized file tensor comes from, with no layout of the
converter restated here. Rounding the checkpoint in its own layout instead would be wrong for gpt-oss: its expert
weights are transposed on the way, so q8_0's 32-value blocks run along the other axis in the file (98% of their
elements then differ from the file's). `GgmlActivations` adds llama.cpp's other rounding: the activations its q8_0
products take.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import gguf
import numpy as np
import torch
from safetensors import safe_open
from safetensors.numpy import save_file
from torch.overrides import TorchFunctionMode

from slimtune.export import convert_hf_to_gguf

Q = gguf.GGMLQuantizationType

# float32 holds every integer up to 2**24 exactly, so element indices survive the converter's f32 copies
_MAX_ELEMENTS = 2**24


def dequantized_tensors(path: Path) -> dict[str, tuple[Q, np.ndarray]]:
    """(type, f32 values in numpy order) of every tensor of the GGUF file `path`."""
    out = {}
    for t in gguf.GGUFReader(path).tensors:
        qtype = Q(t.tensor_type)
        values = gguf.quants.dequantize(np.asarray(t.data), qtype)
        out[t.name] = (qtype, values.reshape(tuple(reversed(t.shape.tolist()))))
    return out


def held_weights_checkpoint(model_dir: Path, gguf_path: Path, out_dir: Path) -> tuple[Path, dict[str, Q]]:
    """A copy of the checkpoint `model_dir` whose elements hold the values the GGUF `gguf_path` (converted from it,
    one file) stores for them, dequantized, wherever the file stores a tensor below f32; the rest keep their values.

    Returns:
        `out_dir`, and the type the file stores each checkpoint tensor's elements at, by checkpoint key.

    Raises:
        ValueError: the checkpoint has too many elements to index exactly in f32.
    """
    weights: dict[str, np.ndarray] = {}
    for file in sorted(model_dir.glob("*.safetensors")):
        with safe_open(file, framework="np") as f:
            weights.update((key, f.get_tensor(key).astype(np.float32)) for key in f.keys())
    sizes = [w.size for w in weights.values()]
    if sum(sizes) > _MAX_ELEMENTS:
        raise ValueError(f"{model_dir}: {sum(sizes)} elements; element indices are exact in f32 up to 2**24 only")
    starts = np.cumsum([0, *sizes])
    index_dir = _copy_without_weights(model_dir, out_dir.with_name(out_dir.name + "-index"))
    indices = {
        key: np.arange(s, s + w.size, dtype=np.float32).reshape(w.shape) for (key, w), s in zip(weights.items(), starts)
    }
    save_file(indices, index_dir / "model.safetensors", metadata={"format": "pt"})
    with np.errstate(over="ignore"):  # -exp(index) of Qwen3.5's A_log: an f32 tensor, never read below
        [index_path] = convert_hf_to_gguf(index_dir, index_dir / "index.gguf", "f32")
    index, held = dequantized_tensors(index_path), dequantized_tensors(gguf_path)
    assert index.keys() == held.keys(), set(index) ^ set(held)
    flat = np.concatenate([w.ravel() for w in weights.values()])
    stored_as = np.full(flat.size, Q.F32, dtype=np.int16)
    for name, (qtype, values) in held.items():
        if qtype == Q.F32:
            continue
        where = index[name][1].astype(np.int64)
        assert np.array_equal(where, index[name][1]) and (stored_as[where] == Q.F32).all(), f"{name}: not rearranged"
        flat[where], stored_as[where] = values, qtype
    shutil.rmtree(index_dir)
    _copy_without_weights(model_dir, out_dir)
    save_file(
        {key: flat[s : s + w.size].reshape(w.shape) for (key, w), s in zip(weights.items(), starts)},
        out_dir / "model.safetensors",
        metadata={"format": "pt"},
    )
    types = {key: np.unique(stored_as[s : s + w.size]) for (key, w), s in zip(weights.items(), starts)}
    assert all(len(t) == 1 for t in types.values()), "a checkpoint tensor stored at two types"
    return out_dir, {key: Q(int(t[0])) for key, t in types.items()}


def _copy_without_weights(model_dir: Path, out_dir: Path) -> Path:
    """`model_dir`'s config and tokenizer files in `out_dir`, for a single model.safetensors to join them."""
    shutil.copytree(model_dir, out_dir, ignore=shutil.ignore_patterns("*.safetensors", "*.safetensors.index.json"))
    return out_dir


class GgmlActivations(TorchFunctionMode):
    """While active, `model`'s matmuls round their activations as ggml's CPU backend does before multiplying them by
    a weight the file holds at q8_0: to q8_0 too (blocks of 32 along the input dimension, one fp16 scale each; its
    dot product multiplies two 8-bit vectors, ggml_vec_dot_q8_0_q8_0). Products with f32 weights (MoE routers) and
    without a weight (attention) stay f32. `types` is `held_weights_checkpoint`'s.

    Measured 2026-11-27 on the pretrained tiny models, q8_0 file against transformers on its weights: the largest logit
    error is 1.7 without this rounding and 0.018 with it (llama; qwen3_moe 1.75 and 0.017), and qwen3_moe picks the
    same next token at 176 of 180 positions without it, at 180 with it.
    """

    def __init__(self, model: torch.nn.Module, types: dict[str, Q]):
        super().__init__()
        if unknown := set(types.values()) - {Q.F32, Q.Q8_0}:
            raise ValueError(f"no activation rounding here for {sorted(t.name for t in unknown)}")
        tensors = dict(model.named_parameters()) | dict(model.named_buffers())
        # a weight kept f32 that could not be found would be rounded for; q8_0 ones may be fused on loading (experts)
        missing = [key for key, t in types.items() if t == Q.F32 and key not in tensors]
        assert not missing, missing
        self._weights = {p.untyped_storage().data_ptr() for p in model.parameters()}
        assert len(self._weights) == len(list(model.parameters())), "parameters share storage"
        self._f32 = {tensors[key].untyped_storage().data_ptr() for key, t in types.items() if t == Q.F32}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in _MATMULS and (ptr := args[1].untyped_storage().data_ptr()) in self._weights and ptr not in self._f32:
            args = (_q8_0_rounded(args[0]), *args[1:])
        return func(*args, **(kwargs or {}))


# nn.Linear calls F.linear; transformers' experts (Qwen3-MoE, gpt-oss) torch._grouped_mm, its default "grouped_mm"
# implementation, or `x @ W` in their eager forward
_MATMULS = (torch.nn.functional.linear, torch._grouped_mm, torch.matmul, torch.Tensor.__matmul__)


def _q8_0_rounded(x: torch.Tensor) -> torch.Tensor:
    """`x` through ggml's quantize_row_q8_0 (its AVX form: scale 127 / amax, ties to even) and back. A block whose
    fp16 scale rounds to 0 (amax under ~4e-6) contributes 0 there, whatever its 8-bit values (127 / amax may be inf)."""
    blocks = x.reshape(*x.shape[:-1], -1, 32)
    amax = blocks.abs().amax(-1, keepdim=True)
    q = torch.round(blocks * torch.where(amax > 0, 127 / amax, 0.0))
    scale = (amax / 127).half().float()
    return torch.where(scale > 0, q * scale, 0.0).reshape(x.shape)
