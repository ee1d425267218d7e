"""llama.cpp's vision projector file (`mmproj`) from a merged Gemma 3, Mistral 3, Qwen3.5 or Gemma 4 checkpoint.

slimtune trains the language model only; `merged/` keeps the vision tower and projector as stored, and the text GGUF
holds the language model. llama.cpp reads images through a second GGUF (`llama-mtmd-cli -m text.gguf --mmproj
mmproj.gguf`, llama-server `--mmproj`): architecture "clip", `clip.vision.*` hyper-parameters and `v.*` / `mm.*`
tensors, which its clip loader (tools/mtmd/clip.cpp) runs by projector type into the text model's embedding space
(the per-family facts: `mmproj_families`). This module writes that file, streamed tensor by tensor
like `gguf_convert` (memory bounded by the largest tensor), and checks it the way llama-mtmd-cli uses it: llama.cpp's
mtmd (text GGUF + mmproj) embeds an image, compared with transformers' `get_image_features` on the same pixels.

Gemma 3 (`Gemma3ForConditionalGeneration`), Mistral 3 (`Mistral3ForConditionalGeneration`), Qwen3.5
(`Qwen3_5ForConditionalGeneration`) and Gemma 4 (`Gemma4ForConditionalGeneration`, its vision tower) get one.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gguf
import numpy as np

from slimtune.core import atomic
from slimtune.export.gguf_convert import _add_value, _loader, _safetensors_keys
from slimtune.export.gguf_header import read_header
from slimtune.export.gguf_verify import _THREADS, GGUFVerifyError, check_complete, load_llama
from slimtune.export.gguf_write import write_tensors
from slimtune.export.mmproj_families import MMPROJ_FAMILIES, MmprojFamily
from slimtune.models.multimodal import text_key

Q = gguf.GGMLQuantizationType
MMPROJ_MODEL_TYPES = tuple(MMPROJ_FAMILIES)  # config.json model_type of the checkpoints an mmproj file is written for
MMPROJ_GGUF_SUFFIX = "-mmproj-f16.gguf"  # <run name>-mmproj-f16.gguf beside the model GGUFs; not a model itself
# what follows a module's name in a stored key: its parameters, and the bounds of Gemma 4's clipped linears
_SUFFIXES = (".weight", ".bias", ".input_max", ".input_min", ".output_max", ".output_min")


@dataclass(frozen=True)
class _Tensor:
    name: str  # the GGUF name
    load: Callable[[], np.ndarray]
    shape: tuple[int, ...]
    qtype: Q


def mmproj_file_name(name: str) -> str:
    """The mmproj file's name beside `<name>-<method>.gguf` (llama.cpp's converter names its f16 one the same way)."""
    return f"{name}{MMPROJ_GGUF_SUFFIX}"


def writes_mmproj(model_dir: Path) -> bool:
    """Whether `model_dir`'s checkpoint gets an mmproj file: a `MMPROJ_MODEL_TYPES` multimodal one."""
    config = json.loads((Path(model_dir) / "config.json").read_text(encoding="utf-8"))
    return config.get("model_type") in MMPROJ_MODEL_TYPES


def convert_mmproj_to_gguf(model_dir: Path, out_path: Path, *, name: str | None = None) -> Path:
    """Write llama.cpp's f16 vision projector GGUF for the multimodal checkpoint in `model_dir`.

    Norms and biases (and Gemma 3's patch convolution and position table, Gemma 4's position tables) stay f32 as
    llama.cpp's converter keeps them; the other matrices are f16. The file appears under `out_path` only once complete.

    Args:
        model_dir: a `save_pretrained` folder of a `MMPROJ_MODEL_TYPES` checkpoint (e.g. `merged/`).
        out_path: the GGUF to write (`mmproj_file_name`).
        name: `general.name`; default: the folder's name.

    Raises:
        ValueError: not a `MMPROJ_MODEL_TYPES` checkpoint, a vision config llama.cpp cannot run, or a vision key
            without a GGUF name.
    """
    model_dir, out_path = Path(model_dir), Path(out_path)
    config = json.loads((model_dir / "config.json").read_text(encoding="utf-8"))
    if config.get("model_type") not in MMPROJ_MODEL_TYPES:
        raise ValueError(
            f"{model_dir / 'config.json'}: model_type {config.get('model_type')!r} has no mmproj writer; "
            f"supported: {', '.join(MMPROJ_MODEL_TYPES)} (the GGUF of its language model is written as usual)"
        )
    family = MMPROJ_FAMILIES[config["model_type"]]
    hparams = _hparams(model_dir, config, family)
    tensors = _plan(model_dir, family, hparams)

    out_path.parent.mkdir(parents=True, exist_ok=True)
    atomic.sweep_leftovers(out_path.parent, out_path.stem)  # what a killed conversion left
    tmp_dir = atomic.mkdtemp(prefix=f".{out_path.stem}.", suffix=".tmp", dir=out_path.parent)
    writer = gguf.GGUFWriter(tmp_dir / out_path.name, gguf.MODEL_ARCH_NAMES[gguf.MODEL_ARCH.MMPROJ])
    try:
        writer.add_type(gguf.GGUFType.MMPROJ)
        writer.add_name(name or model_dir.name)
        writer.add_file_type(int(gguf.LlamaFileType.MOSTLY_F16))
        writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
        writer.add_clip_has_vision_encoder(True)
        writer.add_clip_projector_type(family.projector)
        for key, value in hparams.items():
            _add_value(writer, key, value)  # image mean / std: float32 arrays, as clip.cpp reads them
        [path] = write_tensors(writer, [(t.name, t.shape, t.qtype, t.load) for t in tensors], out_path, tmp_dir)
    finally:
        writer.close()
        shutil.rmtree(tmp_dir, ignore_errors=True)
    return path


def _hparams(model_dir: Path, config: dict[str, Any], family: MmprojFamily) -> dict[str, Any]:
    """The `clip.vision.*` keys, from the config as transformers fills it (config.json may list only what differs
    from the defaults), refusing what llama.cpp's graph for the family would compute differently from transformers."""
    from transformers import AutoConfig

    hparams, problems = family.hparams(model_dir, AutoConfig.for_model(**config))
    if problems:
        raise ValueError(
            f"{model_dir / 'config.json'}: llama.cpp cannot run this {family.model_type} vision tower as "
            f"transformers does: " + "; ".join(problems) + f" (a released {family.model_type} checkpoint has none)"
        )
    mean, std = _mean_std(model_dir, family)
    return {**hparams, gguf.Keys.ClipVision.IMAGE_MEAN: mean, gguf.Keys.ClipVision.IMAGE_STD: std}


def _mean_std(model_dir: Path, family: MmprojFamily) -> tuple[list[float], list[float]]:
    """The image processor's normalization, which llama.cpp applies after scaling pixels to [0, 1]: none (mean 0,
    std 1) where the processor does not normalize, whatever mean and std its config lists."""
    for file, section in (("preprocessor_config.json", None), ("processor_config.json", "image_processor")):
        path = model_dir / file
        if path.is_file():
            processor = json.loads(path.read_text(encoding="utf-8"))
            processor = processor.get(section, {}) if section else processor
            if not processor.get("do_normalize", family.do_normalize):
                return [0.0, 0.0, 0.0], [1.0, 1.0, 1.0]
            if "image_mean" in processor and "image_std" in processor:
                return [float(v) for v in processor["image_mean"]], [float(v) for v in processor["image_std"]]
    return family.mean_std


def _plan(model_dir: Path, family: MmprojFamily, hparams: dict[str, Any]) -> list[_Tensor]:
    from safetensors import safe_open

    # the table numbers Mistral 3's projector linear_1 / linear_2 (mm.1, mm.2) as blocks: 3 names both under a tiny
    # tower
    name_map = gguf.get_tensor_name_map(gguf.MODEL_ARCH.MMPROJ, max(3, hparams[gguf.Keys.ClipVision.BLOCK_COUNT]))
    tensors = []
    for file, stored in _safetensors_keys(model_dir):
        if (text := text_key(stored)) is not None:  # the language model: the text GGUF's, but for a row or so
            if (row := family.text_row(model_dir, text)) is not None:
                with safe_open(file, framework="pt") as f:
                    shape = tuple(f.get_slice(stored).get_shape()[1:])
                tensors.append(_Tensor(row[0], _row_loader(file, stored, row[1]), shape, Q.F32))
            continue
        key = family.vision_key(stored)
        if key is None:
            continue
        name = name_map.get_name(key, try_suffixes=_SUFFIXES)
        if name is None:
            raise ValueError(
                f"{file.name}: tensor {stored!r} has no name in llama.cpp's {family.projector} mmproj; "
                "the vision tower has modules the mmproj writer does not know"
            )
        with safe_open(file, framework="pt") as f:
            shape = tuple(f.get_slice(stored).get_shape())
        transform = family.transform(key, hparams)
        for suffix, piece_shape, piece in family.pieces(key, shape):
            qtype = Q.F32 if family.f32(key, piece_shape) else Q.F16
            load = _loader(file, stored, _then(transform, piece))
            tensors.append(_Tensor(name + suffix, load, piece_shape, qtype))
    if not any(t.name.startswith("mm.") for t in tensors):
        raise ValueError(
            f"{model_dir}: no multi_modal_projector.* tensors; is this a merged {family.architecture} checkpoint?"
        )
    return tensors


def _then(
    first: Callable[[np.ndarray], np.ndarray], second: Callable[[np.ndarray], np.ndarray]
) -> Callable[[np.ndarray], np.ndarray]:
    """`second` after `first`."""
    return lambda w: second(first(w))


def _row_loader(file: Path, key: str, row: int) -> Callable[[], np.ndarray]:
    """One row of a stored matrix, read alone (an embedding table is the largest tensor of a checkpoint)."""

    def load() -> np.ndarray:
        from safetensors import safe_open

        with safe_open(file, framework="pt") as f:
            return f.get_slice(key)[row : row + 1].float().numpy()[0]

    return load


def llama_cpp_image_embeddings(text_gguf: Path, mmproj: Path, rgb: np.ndarray) -> np.ndarray:
    """llama.cpp's embeddings (tokens, text n_embd) of one image, as llama-mtmd-cli computes them before decoding.

    Args:
        text_gguf: the text model GGUF (mtmd checks the projection width against its n_embd).
        mmproj: the vision projector GGUF.
        rgb: (height, width, 3) uint8 pixels; llama.cpp resizes them to the model's image_size and normalizes.

    Raises:
        GGUFVerifyError: llama.cpp refuses the mmproj or cannot tokenize or encode the image.
    """
    import ctypes

    from llama_cpp import _logger, mtmd_cpp

    check_complete(mmproj)
    llm = load_llama(text_gguf, n_ctx=64)
    # clip's log through llama-cpp-python's, which load_llama left printing errors only (not ~200 lines per load)
    mtmd_cpp.mtmd_log_set(_logger.llama_log_callback, ctypes.c_void_p(0))
    params = mtmd_cpp.mtmd_context_params_default()
    params.use_gpu, params.print_timings, params.warmup, params.n_threads = False, False, False, _THREADS
    # the llama_model pointer, as llama-cpp-python's own multimodal chat handlers pass it
    ctx = mtmd_cpp.mtmd_init_from_file(str(mmproj).encode(), llm._model.model, params)
    if not ctx:
        llm.close()
        raise GGUFVerifyError(f"llama.cpp's mtmd could not load {mmproj} with {text_gguf}; its error above says why")
    pixels = np.ascontiguousarray(rgb, dtype=np.uint8)
    bitmap = mtmd_cpp.mtmd_bitmap_init(
        pixels.shape[1], pixels.shape[0], (ctypes.c_uint8 * pixels.size).from_buffer_copy(pixels.tobytes())
    )
    chunks = mtmd_cpp.mtmd_input_chunks_init()
    try:
        prompt = mtmd_cpp.mtmd_default_marker()
        text = mtmd_cpp.mtmd_input_text(text=prompt, text_len=len(prompt), add_special=False, parse_special=True)
        bitmaps = (mtmd_cpp.mtmd_bitmap_p_ctypes * 1)(bitmap)
        if mtmd_cpp.mtmd_tokenize(ctx, chunks, ctypes.byref(text), bitmaps, 1) != 0:
            raise GGUFVerifyError(f"llama.cpp's mtmd could not tokenize an image for {mmproj}")
        for i in range(mtmd_cpp.mtmd_input_chunks_size(chunks)):
            chunk = mtmd_cpp.mtmd_input_chunks_get(chunks, i)
            if mtmd_cpp.mtmd_input_chunk_get_type(chunk) != mtmd_cpp.MTMD_INPUT_CHUNK_TYPE_IMAGE:
                continue  # the text around the image: Gemma 3's <start_of_image> ..., Mistral 3's [IMG_END]
            if mtmd_cpp.mtmd_encode_chunk(ctx, chunk) != 0:
                raise GGUFVerifyError(f"llama.cpp's mtmd could not encode an image with {mmproj}")
            n_tokens, n_embd = mtmd_cpp.mtmd_input_chunk_get_n_tokens(chunk), llm.n_embd()
            out = mtmd_cpp.mtmd_get_output_embd(ctx)
            return np.ctypeslib.as_array(out, shape=(n_tokens * n_embd,)).reshape(n_tokens, n_embd).copy()
        raise GGUFVerifyError(f"llama.cpp's mtmd made no image chunk for {mmproj}")
    finally:
        mtmd_cpp.mtmd_input_chunks_free(chunks)
        mtmd_cpp.mtmd_bitmap_free(bitmap)
        mtmd_cpp.mtmd_free(ctx)
        llm.close()


def transformers_image_embeddings(model_dir: Path, rgb: np.ndarray) -> np.ndarray:
    """transformers' embeddings (tokens, text hidden size) of an image of a size llama.cpp does not resize, as the
    language model receives them (`get_image_features`; Mistral 3's with its [IMG_BREAK] rows), normalized as the
    image processor and llama.cpp normalize it (scaled to [0, 1], then mean and std).

    The whole checkpoint loads in f32 on the CPU, as `verify_gguf` loads the language model.
    """
    import torch
    import transformers

    model_dir = Path(model_dir)
    family = MMPROJ_FAMILIES[json.loads((model_dir / "config.json").read_text(encoding="utf-8"))["model_type"]]
    mean, std = (torch.tensor(v).view(1, 3, 1, 1) for v in _mean_std(model_dir, family))
    pixels = (torch.from_numpy(np.asarray(rgb, dtype=np.float32)).permute(2, 0, 1)[None] / 255.0 - mean) / std
    model = getattr(transformers, family.architecture).from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        return family.reference(model_dir, model, pixels)


def verify_mmproj(mmproj: Path, text_gguf: Path, model_dir: Path, seed: int = 0) -> dict[str, Any]:
    """Compare llama.cpp's image embeddings (text GGUF + mmproj) with transformers' on the checkpoint in `model_dir`,
    for a seeded random image of a size neither side resizes (the family's `verify_size`: Gemma 3's image_size,
    Mistral 3's and Qwen3.5's within llama.cpp's token limits, Gemma 4's fewest tokens llama.cpp keeps).

    Returns:
        A JSON-able dict: mmproj, image_size, tokens, max_abs_diff and max_abs_embedding over the tokens llama.cpp
        made finite, non_finite_tokens (the others).

    Raises:
        GGUFVerifyError: llama.cpp made a non-finite embedding of an image token, or another number of tokens than
            transformers.
    """
    family = MMPROJ_FAMILIES[json.loads((Path(model_dir) / "config.json").read_text(encoding="utf-8"))["model_type"]]
    kv = read_header(mmproj).kv
    height, width = family.verify_size(kv)
    rgb = np.random.default_rng(seed).integers(0, 256, size=(height, width, 3), dtype=np.uint8)
    ours = llama_cpp_image_embeddings(text_gguf, mmproj, rgb)
    reference = transformers_image_embeddings(model_dir, rgb)
    if ours.shape != reference.shape:
        raise GGUFVerifyError(f"{mmproj}: llama.cpp made {ours.shape} image embeddings, transformers {reference.shape}")
    # llama.cpp 0.3.36's pixtral graph fills its [IMG_BREAK] rows by scaling a never-written buffer by 0 and adding
    # the embedding, so a NaN left in that memory stays (3 of 21 calls on a tiny model): such inserted rows are
    # counted, not compared; a non-finite row encoded from the image fails the check
    finite = np.isfinite(ours).all(axis=1)
    inserted = np.zeros_like(finite)
    inserted[family.inserted_rows(height, width, kv)] = True
    if bad := np.flatnonzero(~finite & ~inserted).tolist():
        raise GGUFVerifyError(f"{mmproj}: llama.cpp made non-finite embeddings for image tokens {bad[:8]}")
    return {
        "mmproj": str(mmproj),
        "image_size": height,  # square
        "tokens": ours.shape[0],
        "max_abs_diff": float(np.abs(ours[finite] - reference[finite]).max()),
        "max_abs_embedding": float(np.abs(reference[finite]).max()),
        "non_finite_tokens": int((~finite).sum()),
    }
