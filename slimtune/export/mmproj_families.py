"""What differs between the multimodal families `gguf_mmproj` writes llama.cpp's vision projector for.

One row per config.json model_type: the projector type llama.cpp's clip loader dispatches on (tools/mtmd/clip.cpp),
the `clip.vision.*` keys llama.cpp's converter writes for it (convert_hf_to_gguf.py), how stored keys reach the
`gguf` package's name table, the per-tensor transforms and types, and transformers' embeddings of an image as the
language model receives them (what mtmd's output is compared with).

- Gemma 3 (projector "gemma3"): SigLIP -> average pool -> RMSNorm (Gemma's `1 + w`) -> projection.
- Mistral 3 (projector "pixtral"): Pixtral (RMSNorm, 2D rope, gated FFN) -> RMSNorm -> patch merger -> GELU MLP;
  llama.cpp appends the [IMG_BREAK] token's text embedding after each row of merged patches but the last, as
  Mistral's processor puts [IMG_BREAK] tokens in the prompt.
- Qwen3.5 (projector "qwen3vl_merger"): a ViT (2-frame patch kernel, learned positions resampled to the grid, 2D
  rope) -> LayerNorm -> 2 x 2 patch merger -> GELU MLP; Qwen3-VL's tower without its deepstack mergers.
- Gemma 4 (projector "gemma4v"): a ViT (RMSNorms around attention and gated FFN, 2D rope, x / y position tables,
  optionally clipped linears) -> average pool -> scale and standardize -> RMSNorm -> projection; its audio tower
  (E2B / E4B) is left out.
"""

from __future__ import annotations

import json
import math
from abc import ABC, abstractmethod
from collections.abc import Callable
from pathlib import Path
from typing import Any

import gguf
import numpy as np

from slimtune.export.gguf_convert import permute_rope_rows

Transform = Callable[[np.ndarray], np.ndarray]
_KEYS = gguf.Keys.ClipVision
_CLIP_MEAN_STD = ([0.48145466, 0.4578275, 0.40821073], [0.26862954, 0.26130258, 0.27577711])  # OpenAI CLIP's


class MmprojFamily(ABC):
    """One multimodal family's facts for its mmproj file."""

    model_type: str  # config.json model_type
    architecture: str  # the transformers class of the whole checkpoint
    projector: str  # clip.projector_type
    # the image processor's defaults, for a checkpoint without preprocessor_config.json
    mean_std: tuple[list[float], list[float]]
    do_normalize: bool = True  # the image processor's default: whether it applies mean and std at all

    @abstractmethod
    def hparams(self, model_dir: Path, full: Any) -> tuple[dict[str, Any], list[str]]:
        """The `clip.vision.*` keys (mean and std aside) from the filled-in config, and what llama.cpp would compute
        differently from transformers for this config (empty when it runs it as transformers does)."""

    @abstractmethod
    def vision_key(self, stored: str) -> str | None:
        """`stored` (a vision or projector key) in the layout the `gguf` name table knows, or None to leave out."""

    def transform(self, key: str, hparams: dict[str, Any]) -> Transform:
        """What the stored tensor `key` (in `vision_key`'s layout) becomes in the file."""
        return lambda w: w

    def pieces(self, key: str, shape: tuple[int, ...]) -> list[tuple[str, tuple[int, ...], Transform]]:
        """The file's tensors made of stored tensor `key` of `shape`: (suffix to its GGUF name, shape, what the
        transformed tensor becomes) each; one of the stored shape unless llama.cpp holds it otherwise."""
        return [("", shape, lambda w: w)]

    def f32(self, key: str, shape: tuple[int, ...]) -> bool:
        """Whether llama.cpp's converter keeps `key` f32 in an f16 mmproj (the rest is f16)."""
        return len(shape) < 2

    def text_row(self, model_dir: Path, text_name: str) -> tuple[str, int] | None:
        """(GGUF name, row) of a language-model tensor row the mmproj also holds, or None."""
        return None

    def verify_size(self, kv: dict[str, Any]) -> tuple[int, int]:
        """(height, width) of an image llama.cpp encodes without resizing, for the embedding check."""
        return kv[_KEYS.IMAGE_SIZE], kv[_KEYS.IMAGE_SIZE]

    @abstractmethod
    def reference(self, model_dir: Path, model: Any, pixels: Any) -> np.ndarray:
        """transformers' (tokens, text hidden size) embeddings of normalized `pixels` (1, 3, H, W), in mtmd's order."""

    def inserted_rows(self, height: int, width: int, kv: dict[str, Any]) -> list[int]:
        """The embedding rows of an image of that size that llama.cpp inserts rather than encodes (none)."""
        return []


class _Gemma3(MmprojFamily):
    model_type, architecture = "gemma3", "Gemma3ForConditionalGeneration"
    projector = gguf.VisionProjectorType.GEMMA3
    # Gemma3ImageProcessor's defaults, and what the released Gemma 3 checkpoints' preprocessor_config.json says
    mean_std = ([0.5, 0.5, 0.5], [0.5, 0.5, 0.5])
    # Hub checkpoints have "vision_tower.vision_model.*", transformers 5.23 saves "vision_tower.*" without it and
    # transformers 5's in-memory names start with "model."; the `gguf` name table knows the Hub's
    _siglip = "vision_tower.vision_model."

    def hparams(self, model_dir: Path, full: Any) -> tuple[dict[str, Any], list[str]]:
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
        return {
            _KEYS.PROJECTION_DIM: text.hidden_size,  # llama.cpp checks it against the text model's n_embd
            **_tower(vision, vision.image_size),
            _KEYS.Attention.LAYERNORM_EPS: float(vision.layer_norm_eps),
            _KEYS.USE_GELU: True,
            # the average pool's kernel: 64 patches per side pooled to 16 in the released models (llama.cpp's 4)
            _KEYS.Projector.SCALE_FACTOR: patches // tokens_per_side,
        }, problems

    def vision_key(self, stored: str) -> str | None:
        key = stored.removeprefix("model.")
        if key.startswith("vision_tower.") and not key.startswith(self._siglip):
            key = self._siglip + key.removeprefix("vision_tower.")
        if key.startswith(self._siglip + "head."):
            return None  # SigLIP's pooling head: Gemma 3 reads the last hidden state, never the head
        return key.replace("mm_input_projection_weight", "mm_input_projection.weight")

    def transform(self, key: str, hparams: dict[str, Any]) -> Transform:
        if key.endswith("mm_soft_emb_norm.weight"):
            return lambda w: w + 1.0  # Gemma's RMSNorm multiplies by (1 + w); clip.cpp multiplies by w
        return lambda w: w

    def f32(self, key: str, shape: tuple[int, ...]) -> bool:
        return len(shape) < 2 or ".embeddings." in key  # the patch convolution and the position table

    def reference(self, model_dir: Path, model: Any, pixels: Any) -> np.ndarray:
        return model.get_image_features(pixels).pooler_output[0].numpy()


# clip.cpp's pixtral graph: rope_theta fixed at 10000, the vision RMSNorm eps the converter writes (transformers'
# Pixtral hard-codes 1e-5) also used for the projector's norm, and images resized into 8..1024 merged tokens
_PIXTRAL_ROPE_THETA = 10000.0
_PIXTRAL_EPS = 1e-5
_PIXTRAL_MAX_TOKENS = 1024
_PIXTRAL_ACTS = {"silu": _KEYS.USE_SILU, "gelu": _KEYS.USE_GELU}  # as the converter maps hidden_act
_IMG_BREAK = "[IMG_BREAK]"


class _Mistral3(MmprojFamily):
    model_type, architecture = "mistral3", "Mistral3ForConditionalGeneration"
    projector = gguf.VisionProjectorType.PIXTRAL
    # PixtralImageProcessor's defaults (CLIP's), as the released checkpoints' preprocessor_config.json says
    mean_std = _CLIP_MEAN_STD

    def hparams(self, model_dir: Path, full: Any) -> tuple[dict[str, Any], list[str]]:
        vision, text = full.vision_config, full.get_text_config()
        theta = (vision.rope_parameters or {}).get("rope_theta", _PIXTRAL_ROPE_THETA)
        problems = []
        if full.vision_feature_layer != -1:
            problems.append(f"vision_feature_layer {full.vision_feature_layer!r} (llama.cpp reads the last layer)")
        if theta != _PIXTRAL_ROPE_THETA:
            problems.append(f"vision rope_theta {theta} (llama.cpp's pixtral graph fixes it at 10000)")
        if vision.hidden_act not in _PIXTRAL_ACTS:
            problems.append(f"hidden_act {vision.hidden_act!r} (llama.cpp's pixtral tower runs silu or gelu)")
        if full.projector_hidden_act != "gelu":
            problems.append(f"projector_hidden_act {full.projector_hidden_act!r} (llama.cpp's projector runs gelu)")
        if text.rms_norm_eps != _PIXTRAL_EPS:
            problems.append(
                f"text rms_norm_eps {text.rms_norm_eps} (transformers' projector norm uses it, llama.cpp the vision "
                f"tower's {_PIXTRAL_EPS})"
            )
        if _img_break_id(model_dir) is None:
            problems.append(f"no {_IMG_BREAK} token in the tokenizer (llama.cpp puts its embedding after each row)")
        return {
            _KEYS.PROJECTION_DIM: text.hidden_size,
            **_tower(vision, vision.image_size),
            _KEYS.Attention.LAYERNORM_EPS: _PIXTRAL_EPS,
            _PIXTRAL_ACTS.get(vision.hidden_act, _KEYS.USE_GELU): True,
            _KEYS.SPATIAL_MERGE_SIZE: full.spatial_merge_size,
        }, problems

    def vision_key(self, stored: str) -> str | None:
        return stored.removeprefix("model.")  # transformers 5's in-memory names; the Hub's have no "model."

    def transform(self, key: str, hparams: dict[str, Any]) -> Transform:
        # transformers' Pixtral rotates halves of each head; ggml's rope (as the converter permutes) pairs
        if key.endswith(("attention.q_proj.weight", "attention.k_proj.weight")):
            return lambda w: permute_rope_rows(w, hparams[_KEYS.Attention.HEAD_COUNT])
        return lambda w: w

    def text_row(self, model_dir: Path, text_name: str) -> tuple[str, int] | None:
        if text_name != "model.embed_tokens.weight":
            return None
        return gguf.TENSOR_NAMES[gguf.MODEL_TENSOR.V_TOK_EMBD_IMG_BREAK], _img_break_id(model_dir)

    def verify_size(self, kv: dict[str, Any]) -> tuple[int, int]:
        align = kv[_KEYS.PATCH_SIZE] * kv[_KEYS.SPATIAL_MERGE_SIZE]
        side = min(kv[_KEYS.IMAGE_SIZE] // align, math.isqrt(_PIXTRAL_MAX_TOKENS)) * align
        return side, side

    def inserted_rows(self, height: int, width: int, kv: dict[str, Any]) -> list[int]:
        """[IMG_BREAK] after each row of merged patches but the last."""
        ratio = kv[_KEYS.PATCH_SIZE] * kv[_KEYS.SPATIAL_MERGE_SIZE]
        rows, cols = height // ratio, width // ratio
        return [r * (cols + 1) + cols for r in range(rows - 1)]

    def reference(self, model_dir: Path, model: Any, pixels: Any) -> np.ndarray:
        import torch

        height, width = pixels.shape[-2:]
        features = model.get_image_features(
            pixels, image_sizes=torch.tensor([[height, width]]), vision_feature_layer=model.config.vision_feature_layer
        ).pooler_output[0]
        ratio = model.config.vision_config.patch_size * model.config.spatial_merge_size
        rows = features.reshape(height // ratio, width // ratio, -1)
        brk = model.get_input_embeddings().weight[_img_break_id(model_dir)]
        parts = [part for row in rows for part in (row, brk[None])][:-1]  # no [IMG_BREAK] after the last row
        return torch.cat(parts).numpy()


# clip.cpp's qwen3vl graph: patches merged 2 x 2 and rope_theta 10000 fixed, one eps for every LayerNorm (transformers'
# Qwen3.5 tower hard-codes 1e-6 in each, which is written; the converter writes the text model's rms_norm_eps), and
# images resized into 8..4096 merged tokens
_QWEN_MERGE = 2
_QWEN_FRAMES = 2  # the patch kernel's temporal_patch_size: an image is its own 2 frames
_QWEN_ROPE_THETA = 10000.0
_QWEN_EPS = 1e-6
_QWEN_MIN_TOKENS = 8


class _Qwen35(MmprojFamily):
    model_type, architecture = "qwen3_5", "Qwen3_5ForConditionalGeneration"
    projector = gguf.VisionProjectorType.QWEN3VL
    mean_std = _CLIP_MEAN_STD  # Qwen2VLImageProcessor's defaults
    # the merger's names in the `gguf` table: Qwen2-VL's (the converter renames Qwen3-VL's the same way)
    _merger = {"linear_fc1.": "mlp.0.", "linear_fc2.": "mlp.2.", "norm.": "ln_q."}

    def hparams(self, model_dir: Path, full: Any) -> tuple[dict[str, Any], list[str]]:
        vision, text = full.vision_config, full.get_text_config()
        side = math.isqrt(vision.num_position_embeddings)
        theta = (vision.rope_parameters or {}).get("rope_theta", _QWEN_ROPE_THETA)
        problems = []
        if vision.spatial_merge_size != _QWEN_MERGE:
            problems.append(f"spatial_merge_size {vision.spatial_merge_size} (llama.cpp's qwen3vl graph merges 2 x 2)")
        if vision.temporal_patch_size != _QWEN_FRAMES:
            problems.append(
                f"temporal_patch_size {vision.temporal_patch_size} (llama.cpp holds the patch kernel as 2 frames)"
            )
        if side**2 != vision.num_position_embeddings:
            problems.append(
                f"num_position_embeddings {vision.num_position_embeddings} is not a square (llama.cpp's position "
                "grid is)"
            )
        if theta != _QWEN_ROPE_THETA:
            problems.append(f"vision rope_theta {theta} (llama.cpp's qwen3vl graph fixes it at 10000)")
        if vision.hidden_act != "gelu_pytorch_tanh":  # clip.use_gelu is ggml's tanh GELU
            problems.append(f"hidden_act {vision.hidden_act!r} (llama.cpp's qwen3vl tower runs gelu_pytorch_tanh)")
        if vision.out_hidden_size != text.hidden_size:
            problems.append(
                f"out_hidden_size {vision.out_hidden_size} is not the text hidden_size {text.hidden_size} (llama.cpp "
                "checks the projection against the text model)"
            )
        return {
            _KEYS.PROJECTION_DIM: text.hidden_size,
            # the converter's: the position grid's side in pixels
            **_tower(vision, side * vision.patch_size),
            _KEYS.Attention.LAYERNORM_EPS: _QWEN_EPS,
            _KEYS.USE_GELU: True,
            _KEYS.SPATIAL_MERGE_SIZE: vision.spatial_merge_size,
        }, problems

    def vision_key(self, stored: str) -> str | None:
        if stored.startswith("mtp."):
            return None  # the multi-token prediction: the language model's, not in any GGUF
        key = stored.removeprefix("model.")  # the Hub's and transformers 5's names: "model.visual.*"
        if key.startswith("visual.merger."):
            rest = key.removeprefix("visual.merger.")
            old = next((old for old in self._merger if rest.startswith(old)), "")
            key = "visual.merger." + self._merger.get(old, "") + rest.removeprefix(old)
        return key

    def pieces(self, key: str, shape: tuple[int, ...]) -> list[tuple[str, tuple[int, ...], Transform]]:
        if key != "visual.patch_embed.proj.weight":
            return super().pieces(key, shape)
        # the Conv3d kernel (out, channels, frames, p, p) as one 2D kernel per frame, "v.patch_embd.weight" and
        # "v.patch_embd.weight.1"; clip.cpp adds both over the image
        frame = (shape[0], shape[1], *shape[3:])
        return [("", frame, lambda w: w[:, :, 0]), (".1", frame, lambda w: w[:, :, 1])]

    def f32(self, key: str, shape: tuple[int, ...]) -> bool:
        # not the converter's f16 position table: for an image of the grid's own size clip.cpp adds it unresampled to
        # f32 patches, an f32 + f16 addition ggml's CPU backend aborts the process on (llama-cpp-python 0.3.36)
        return len(shape) < 2 or key == "visual.pos_embed.weight"

    def verify_size(self, kv: dict[str, Any]) -> tuple[int, int]:
        # the position grid's side in whole merged tokens, or llama.cpp's fewest tokens
        align = kv[_KEYS.PATCH_SIZE] * kv[_KEYS.SPATIAL_MERGE_SIZE]
        side = max(kv[_KEYS.IMAGE_SIZE] // align, math.isqrt(_QWEN_MIN_TOKENS - 1) + 1) * align
        return side, side

    def reference(self, model_dir: Path, model: Any, pixels: Any) -> np.ndarray:
        import torch

        vision = model.config.vision_config
        p, m, frames = vision.patch_size, vision.spatial_merge_size, vision.temporal_patch_size
        _, channels, height, width = pixels.shape
        grid_h, grid_w = height // p, width // p
        # Qwen2VLImageProcessor's patches: 2 x 2 windows in raster order, each one's patches in raster order, a patch
        # as (channel, frame, row, column) with the image repeated over the frames
        patches = pixels.reshape(channels, grid_h // m, m, p, grid_w // m, m, p).permute(1, 4, 2, 5, 0, 3, 6)
        patches = patches.unsqueeze(5).expand(-1, -1, -1, -1, -1, frames, -1, -1)
        grid = torch.tensor([[1, grid_h, grid_w]])
        features = model.get_image_features(patches.reshape(grid_h * grid_w, -1), image_grid_thw=grid)
        return features.pooler_output[0].numpy()


# clip.cpp's gemma4v graph: rope_theta 100 fixed, images resized into 70..1120 pooled tokens; the converter writes
# image_size 224, which that graph does not read
_GEMMA4_ROPE_THETA = 100.0
_GEMMA4_MIN_TOKENS = 70
_GEMMA4_IMAGE_SIZE = 224


class _Gemma4(MmprojFamily):
    model_type, architecture = "gemma4", "Gemma4ForConditionalGeneration"
    projector = gguf.VisionProjectorType.GEMMA4V
    # Gemma4ImageProcessor only rescales to [0, 1] (do_normalize False); the model maps pixels to [-1, 1] as clip.cpp
    mean_std, do_normalize = ([0.0, 0.0, 0.0], [1.0, 1.0, 1.0]), False
    _encoder = "model.vision_tower.encoder."  # under the `gguf` table's "vision_model.model." (Llama 4's names)

    def hparams(self, model_dir: Path, full: Any) -> tuple[dict[str, Any], list[str]]:
        vision, text = full.vision_config, full.get_text_config()
        theta = (vision.rope_parameters or {}).get("rope_theta", _GEMMA4_ROPE_THETA)
        problems = []
        if theta != _GEMMA4_ROPE_THETA:
            problems.append(f"vision rope_theta {theta} (llama.cpp's gemma4v graph fixes it at 100)")
        if vision.hidden_activation != "gelu_pytorch_tanh":  # clip.use_gelu is ggml's tanh GELU
            problems.append(
                f"hidden_activation {vision.hidden_activation!r} (llama.cpp's gemma4v tower runs gelu_pytorch_tanh)"
            )
        if vision.num_key_value_heads != vision.num_attention_heads:  # the converter writes no head_count_kv
            problems.append(
                f"num_key_value_heads {vision.num_key_value_heads} is not num_attention_heads "
                f"{vision.num_attention_heads} (llama.cpp's gemma4v attention has as many)"
            )
        if vision.head_dim * vision.num_attention_heads != vision.hidden_size:  # nor head_dim
            problems.append(
                f"head_dim {vision.head_dim} x {vision.num_attention_heads} heads is not hidden_size "
                f"{vision.hidden_size} (llama.cpp's head size is hidden_size / heads)"
            )
        return {
            _KEYS.PROJECTION_DIM: text.hidden_size,
            **_tower(vision, _GEMMA4_IMAGE_SIZE),
            # every RMSNorm of the tower and the embedder's (the converter writes 1e-6 whatever rms_norm_eps says)
            _KEYS.Attention.LAYERNORM_EPS: float(vision.rms_norm_eps),
            # not the converter's: it writes no activation, so clip.cpp runs gelu_quick where transformers runs
            # gelu_pytorch_tanh (tests/test_gguf_mmproj_gemma4.py measures what that costs)
            _KEYS.USE_GELU: True,
            # clip.cpp's default is the released 3; the converter leaves it out
            _KEYS.Projector.SCALE_FACTOR: vision.pooling_kernel_size,
        }, problems

    def vision_key(self, stored: str) -> str | None:
        if stored.startswith(("model.audio_tower.", "model.embed_audio.")):
            return None  # E2B / E4B's audio tower: an audio projector, not this file's
        if stored.startswith(self._encoder):  # a clippable linear's weight under its module's name, as the table has it
            return "vision_model.model." + stored.removeprefix(self._encoder).replace(".linear.weight", ".weight")
        if stored.endswith("position_embedding_table"):  # a bare parameter; clip.cpp reads "v.position_embd.weight"
            return stored + ".weight"
        return stored

    def pieces(self, key: str, shape: tuple[int, ...]) -> list[tuple[str, tuple[int, ...], Transform]]:
        if not shape:  # a clipped linear's bound: clip.cpp reads a 1-element tensor
            return [("", (1,), lambda w: w.reshape(1))]
        if key.endswith("patch_embedder.input_proj.weight"):
            # the linear over (row, column, channel)-flattened patches as clip.cpp's 2D convolution kernel
            p = math.isqrt(shape[1] // 3)
            return [("", (shape[0], 3, p, p), lambda w: w.reshape(shape[0], p, p, 3).transpose(0, 3, 1, 2))]
        return super().pieces(key, shape)

    def f32(self, key: str, shape: tuple[int, ...]) -> bool:
        return len(shape) < 2 or "position_embedding_table" in key

    def verify_size(self, kv: dict[str, Any]) -> tuple[int, int]:
        # the fewest pooled tokens llama.cpp keeps an image at: 9 x 9
        side = (math.isqrt(_GEMMA4_MIN_TOKENS - 1) + 1) * kv[_KEYS.PATCH_SIZE] * kv[_KEYS.Projector.SCALE_FACTOR]
        return side, side

    def reference(self, model_dir: Path, model: Any, pixels: Any) -> np.ndarray:
        import torch

        p = model.config.vision_config.patch_size
        _, channels, height, width = pixels.shape
        # Gemma4ImageProcessor's patches: raster order, each (row, column, channel) flattened, at (x, y) positions
        patches = pixels.reshape(channels, height // p, p, width // p, p).permute(1, 3, 2, 4, 0)
        patches = patches.reshape(1, -1, p * p * channels)
        ys, xs = torch.meshgrid(torch.arange(height // p), torch.arange(width // p), indexing="ij")
        positions = torch.stack([xs.flatten(), ys.flatten()], dim=-1)[None]
        return model.get_image_features(patches, image_position_ids=positions).pooler_output[0].numpy()


def _tower(vision: Any, image_size: int) -> dict[str, Any]:
    """The keys every vision tower has, under the names llama.cpp's converter writes them."""
    return {
        _KEYS.IMAGE_SIZE: image_size,
        _KEYS.PATCH_SIZE: vision.patch_size,
        _KEYS.EMBEDDING_LENGTH: vision.hidden_size,
        _KEYS.FEED_FORWARD_LENGTH: vision.intermediate_size,
        _KEYS.BLOCK_COUNT: vision.num_hidden_layers,
        _KEYS.Attention.HEAD_COUNT: vision.num_attention_heads,
    }


def _img_break_id(model_dir: Path) -> int | None:
    """[IMG_BREAK]'s id, looked up where llama.cpp's converter looks: tokenizer_config.json's added tokens, then
    tokenizer.json's."""
    config, tokenizer = Path(model_dir) / "tokenizer_config.json", Path(model_dir) / "tokenizer.json"
    if config.is_file():
        added = json.loads(config.read_text(encoding="utf-8")).get("added_tokens_decoder") or {}
        for token_id, token in added.items():
            if token.get("content") == _IMG_BREAK:
                return int(token_id)
    if tokenizer.is_file():
        for token in json.loads(tokenizer.read_text(encoding="utf-8")).get("added_tokens", []):
            if token.get("content") == _IMG_BREAK:
                return int(token["id"])
    return None


MMPROJ_FAMILIES: dict[str, MmprojFamily] = {f.model_type: f for f in (_Gemma3(), _Mistral3(), _Qwen35(), _Gemma4())}
