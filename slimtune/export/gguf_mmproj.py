"""llama.cpp's vision projector file (`mmproj`) from a merged Gemma 3 multimodal checkpoint.

slimtune trains the language model only; `merged/` keeps the vision tower and projector as stored, and the text GGUF
holds the language model. llama.cpp reads images through a second GGUF (`llama-mtmd-cli -m text.gguf --mmproj
mmproj.gguf`, llama-server `--mmproj`): architecture "clip", `clip.vision.*` hyper-parameters and `v.*` / `mm.*`
tensors, which its clip loader (tools/mtmd/clip.cpp, projector type "gemma3") runs as SigLIP -> average pool ->
RMSNorm -> projection into the text model's embedding space. This module writes that file, streamed tensor by tensor
like `gguf_convert` (memory bounded by the largest tensor), and checks it the way llama-mtmd-cli uses it: llama.cpp's
mtmd (text GGUF + mmproj) embeds an image, compared with transformers' `get_image_features` on the same pixels.

Only Gemma 3 (`Gemma3ForConditionalGeneration`) gets one: Mistral 3's, Gemma 4's and Qwen3.5's towers have other
projector types in llama.cpp, not written here yet.
"""

from __future__ import annotations

import json
import math
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
from slimtune.models.multimodal import text_key

Q = gguf.GGMLQuantizationType
MMPROJ_MODEL_TYPES = ("gemma3",)  # config.json model_type of the checkpoints an mmproj file is written for
MMPROJ_GGUF_SUFFIX = "-mmproj-f16.gguf"  # <run name>-mmproj-f16.gguf beside the model GGUFs; not a model itself
# Gemma3ImageProcessor's defaults, and what the released Gemma 3 checkpoints' preprocessor_config.json says
_DEFAULT_MEAN_STD = ([0.5, 0.5, 0.5], [0.5, 0.5, 0.5])
# The checkpoint layouts the merge keeps (slimtune.models.multimodal): transformers 5's in-memory names start with
# "model.", the Hub's checkpoints have "vision_tower.vision_model.*", transformers 5.23 saves "vision_tower.*" without
# "vision_model."; gguf's name tables know the Hub's layout.
_SIGLIP = "vision_tower.vision_model."


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
    """Whether `model_dir`'s checkpoint gets an mmproj file: a Gemma 3 multimodal one."""
    config = json.loads((Path(model_dir) / "config.json").read_text(encoding="utf-8"))
    return config.get("model_type") in MMPROJ_MODEL_TYPES


def convert_mmproj_to_gguf(model_dir: Path, out_path: Path, *, name: str | None = None) -> Path:
    """Write llama.cpp's f16 vision projector GGUF for the Gemma 3 multimodal checkpoint in `model_dir`.

    Norms, biases, the patch convolution and the position table stay f32 (as llama.cpp's converter keeps them);
    the other matrices are f16. The file appears under `out_path` only once complete.

    Args:
        model_dir: a `save_pretrained` folder of `Gemma3ForConditionalGeneration` (e.g. `merged/`).
        out_path: the GGUF to write (`mmproj_file_name`).
        name: `general.name`; default: the folder's name.

    Raises:
        ValueError: not a Gemma 3 multimodal checkpoint, a vision config llama.cpp cannot run, or a vision key
            without a GGUF name.
    """
    model_dir, out_path = Path(model_dir), Path(out_path)
    config = json.loads((model_dir / "config.json").read_text(encoding="utf-8"))
    if config.get("model_type") not in MMPROJ_MODEL_TYPES:
        raise ValueError(
            f"{model_dir / 'config.json'}: model_type {config.get('model_type')!r} has no mmproj writer; "
            f"supported: {', '.join(MMPROJ_MODEL_TYPES)} (the GGUF of its language model is written as usual)"
        )
    hparams = _hparams(model_dir, config)
    tensors = _plan(model_dir, hparams[gguf.Keys.ClipVision.BLOCK_COUNT])

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
        writer.add_clip_projector_type(gguf.VisionProjectorType.GEMMA3)
        for key, value in hparams.items():
            _add_value(writer, key, value)  # image mean / std: float32 arrays, as clip.cpp reads them
        [path] = write_tensors(writer, [(t.name, t.shape, t.qtype, t.load) for t in tensors], out_path, tmp_dir)
    finally:
        writer.close()
        shutil.rmtree(tmp_dir, ignore_errors=True)
    return path


def _hparams(model_dir: Path, config: dict[str, Any]) -> dict[str, Any]:
    """The `clip.vision.*` keys, from the config as transformers fills it (config.json may list only what differs
    from the defaults), refusing what llama.cpp's gemma3 graph would compute differently from transformers."""
    from transformers import AutoConfig

    full = AutoConfig.for_model(**config)
    vision, text = full.vision_config, full.get_text_config()
    patches = vision.image_size // vision.patch_size
    tokens_per_side = math.isqrt(full.mm_tokens_per_image)
    problems = []
    if vision.image_size % vision.patch_size:
        problems.append(f"image_size {vision.image_size} is not a multiple of patch_size {vision.patch_size}")
    if tokens_per_side**2 != full.mm_tokens_per_image or patches % tokens_per_side:
        problems.append(
            f"mm_tokens_per_image {full.mm_tokens_per_image} is not the square of a divisor of the {patches} "
            "patches per side (llama.cpp pools the patch grid into a square of tokens)"
        )
    if vision.intermediate_size == vision.hidden_size:
        # clip.cpp takes an ffn_down of the embedding width for an old file's swapped up/down and swaps them back
        problems.append(f"intermediate_size equals hidden_size ({vision.hidden_size})")
    if vision.hidden_act != "gelu_pytorch_tanh":  # clip.use_gelu is ggml's tanh GELU
        problems.append(f"hidden_act {vision.hidden_act!r} (llama.cpp's gemma3 projector runs gelu_pytorch_tanh)")
    if problems:
        raise ValueError(
            f"{model_dir / 'config.json'}: llama.cpp cannot run this vision tower as Gemma 3's: "
            + "; ".join(problems)
            + " (a released Gemma 3 checkpoint has none of these)"
        )
    mean, std = _mean_std(model_dir)
    keys = gguf.Keys.ClipVision
    return {
        keys.PROJECTION_DIM: text.hidden_size,  # llama.cpp checks it against the text model's n_embd
        keys.IMAGE_SIZE: vision.image_size,
        keys.PATCH_SIZE: vision.patch_size,
        keys.EMBEDDING_LENGTH: vision.hidden_size,
        keys.FEED_FORWARD_LENGTH: vision.intermediate_size,
        keys.BLOCK_COUNT: vision.num_hidden_layers,
        keys.Attention.HEAD_COUNT: vision.num_attention_heads,
        keys.Attention.LAYERNORM_EPS: float(vision.layer_norm_eps),
        keys.IMAGE_MEAN: mean,
        keys.IMAGE_STD: std,
        keys.USE_GELU: True,
        # the average pool's kernel: 64 patches per side pooled to 16 in the released models (llama.cpp's default 4)
        keys.Projector.SCALE_FACTOR: patches // tokens_per_side,
    }


def _mean_std(model_dir: Path) -> tuple[list[float], list[float]]:
    """The image processor's normalization, which llama.cpp applies after scaling pixels to [0, 1]."""
    for file, section in (("preprocessor_config.json", None), ("processor_config.json", "image_processor")):
        path = model_dir / file
        if path.is_file():
            processor = json.loads(path.read_text(encoding="utf-8"))
            processor = processor.get(section, {}) if section else processor
            if "image_mean" in processor and "image_std" in processor:
                return [float(v) for v in processor["image_mean"]], [float(v) for v in processor["image_std"]]
    return _DEFAULT_MEAN_STD


def _vision_key(stored: str) -> str | None:
    """`stored` in the Hub's layout with `.weight` on bare parameters, or None for a weight the mmproj leaves out."""
    if text_key(stored) is not None:
        return None  # the language model: the text GGUF's
    key = stored.removeprefix("model.")
    if key.startswith("vision_tower.") and not key.startswith(_SIGLIP):
        key = _SIGLIP + key.removeprefix("vision_tower.")
    if key.startswith(_SIGLIP + "head."):
        return None  # SigLIP's pooling head: Gemma 3 reads the last hidden state, never the head
    return key.replace("mm_input_projection_weight", "mm_input_projection.weight")


def _plan(model_dir: Path, n_layers: int) -> list[_Tensor]:
    from safetensors import safe_open

    name_map = gguf.get_tensor_name_map(gguf.MODEL_ARCH.MMPROJ, n_layers)
    tensors = []
    for file, stored in _safetensors_keys(model_dir):
        key = _vision_key(stored)
        if key is None:
            continue
        name = name_map.get_name(key, try_suffixes=(".weight", ".bias"))
        if name is None:
            raise ValueError(
                f"{file.name}: tensor {stored!r} has no name in llama.cpp's gemma3 mmproj; "
                "the vision tower has modules the mmproj writer does not know"
            )
        with safe_open(file, framework="pt") as f:
            shape = tuple(f.get_slice(stored).get_shape())
        # Gemma's RMSNorm multiplies by (1 + w); clip.cpp multiplies by w
        shift = key.endswith("mm_soft_emb_norm.weight")
        transform = (lambda w: w + 1.0) if shift else (lambda w: w)
        # llama.cpp's converter keeps the embeddings (patch convolution, position table) in f32
        qtype = Q.F32 if len(shape) < 2 or ".embeddings." in key else Q.F16
        tensors.append(_Tensor(name, _loader(file, stored, transform), shape, qtype))
    if not any(t.name.startswith("mm.") for t in tensors):
        raise ValueError(f"{model_dir}: no multi_modal_projector.* tensors; is this a merged Gemma 3 checkpoint?")
    return tensors


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
                continue  # Gemma 3 wraps the image in <start_of_image> ... <end_of_image> text
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
    """transformers' `get_image_features` (tokens, text hidden size) of an image already at the model's image_size,
    normalized as the image processor and llama.cpp normalize it (scaled to [0, 1], then mean and std).

    The whole checkpoint loads in f32 on the CPU, as `verify_gguf` loads the language model.
    """
    import torch
    from transformers import Gemma3ForConditionalGeneration

    mean, std = (torch.tensor(v).view(1, 3, 1, 1) for v in _mean_std(Path(model_dir)))
    pixels = (torch.from_numpy(np.asarray(rgb, dtype=np.float32)).permute(2, 0, 1)[None] / 255.0 - mean) / std
    model = Gemma3ForConditionalGeneration.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        return model.get_image_features(pixels).pooler_output[0].numpy()


def verify_mmproj(mmproj: Path, text_gguf: Path, model_dir: Path, seed: int = 0) -> dict[str, Any]:
    """Compare llama.cpp's image embeddings (text GGUF + mmproj) with transformers' on the checkpoint in `model_dir`,
    for a seeded random image at the model's image_size (so that neither side resizes it).

    Returns:
        A JSON-able dict: mmproj, image_size, tokens, max_abs_diff, max_abs_embedding.
    """
    size = read_header(mmproj).kv[gguf.Keys.ClipVision.IMAGE_SIZE]
    rgb = np.random.default_rng(seed).integers(0, 256, size=(size, size, 3), dtype=np.uint8)
    ours = llama_cpp_image_embeddings(text_gguf, mmproj, rgb)
    reference = transformers_image_embeddings(model_dir, rgb)
    if ours.shape != reference.shape:
        raise GGUFVerifyError(f"{mmproj}: llama.cpp made {ours.shape} image embeddings, transformers {reference.shape}")
    return {
        "mmproj": str(mmproj),
        "image_size": size,
        "tokens": ours.shape[0],
        "max_abs_diff": float(np.abs(ours - reference).max()),
        "max_abs_embedding": float(np.abs(reference).max()),
    }
