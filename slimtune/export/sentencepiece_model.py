"""Read a SentencePiece `tokenizer.model` (a serialized `ModelProto`) without protobuf or sentencepiece.

llama.cpp's SPM vocabulary is the proto's pieces, scores and types as they are, so reading them straight
from the file is the exact conversion. Neither `sentencepiece` nor `protobuf` is a dependency of slimtune
(transformers' `sentencepiece_model_pb2` needs protobuf), and the handful of fields needed here are plain
protobuf wire format: varints, 32-bit floats and length-delimited sub-messages. Field numbers are those of
sentencepiece's `sentencepiece_model.proto`.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path

# sentencepiece_model.proto field numbers
_MODEL_PIECES, _MODEL_TRAINER, _MODEL_NORMALIZER = 1, 2, 3
_PIECE_TEXT, _PIECE_SCORE, _PIECE_TYPE = 1, 2, 3
_TRAINER_MODEL_TYPE, _TRAINER_WS_SUFFIX, _TRAINER_BYTE_FALLBACK = 3, 24, 35
_NORM_NAME, _NORM_DUMMY_PREFIX, _NORM_EXTRA_WS, _NORM_ESCAPE_WS = 1, 3, 4, 5
MODEL_TYPES = {1: "unigram", 2: "bpe", 3: "word", 4: "char"}


@dataclass(frozen=True)
class SentencePieceModel:
    """The parts of a `ModelProto` that decide how llama.cpp tokenizes.

    Attributes:
        pieces, scores, types: one per id; types use sentencepiece's enum (1 normal, 2 unknown, 3 control,
            4 user-defined, 5 unused, 6 byte), which is also GGUF's `TokenType`.
        model_type: "unigram", "bpe", "word" or "char".
        normalizer: the normalization rule's name ("identity" applies none).
        add_dummy_prefix: a "▁" goes in front of the text (llama.cpp's `add_space_prefix`).
        remove_extra_whitespaces: runs of spaces collapse and outer spaces go (llama.cpp's SPM does not).
        escape_whitespaces: spaces become "▁".
        treat_whitespace_as_suffix: "▁" ends words instead of starting them.
        byte_fallback: unknown characters are spelled with the <0xNN> byte pieces.
    """

    pieces: list[str]
    scores: list[float]
    types: list[int]
    model_type: str
    normalizer: str
    add_dummy_prefix: bool
    remove_extra_whitespaces: bool
    escape_whitespaces: bool
    treat_whitespace_as_suffix: bool
    byte_fallback: bool


def _fields(buf: bytes):
    """Yield (field number, value) of one message: ints for varints, bytes for length-delimited, raw 4/8 bytes."""
    pos, end = 0, len(buf)
    while pos < end:
        key, pos = _varint(buf, pos)
        field, wire = key >> 3, key & 7
        if wire == 0:
            value, pos = _varint(buf, pos)
        elif wire == 1:
            value, pos = buf[pos : pos + 8], pos + 8
        elif wire == 2:
            size, pos = _varint(buf, pos)
            value, pos = buf[pos : pos + size], pos + size
        elif wire == 5:
            value, pos = buf[pos : pos + 4], pos + 4
        else:
            raise ValueError(f"protobuf wire type {wire} at byte {pos} is not used by sentencepiece models")
        yield field, value


def _varint(buf: bytes, pos: int) -> tuple[int, int]:
    result = shift = 0
    while True:
        byte = buf[pos]
        pos += 1
        result |= (byte & 0x7F) << shift
        if byte < 0x80:
            return result, pos
        shift += 7


def read_sentencepiece_model(path: Path) -> SentencePieceModel:
    """Parse `path` (a `tokenizer.model`).

    Raises:
        ValueError: the file is not a SentencePiece model (naming the file).
    """
    pieces: list[str] = []
    scores: list[float] = []
    types: list[int] = []
    trainer: dict[int, int] = {}
    normalizer: dict[int, int | bytes] = {}
    try:
        for field, value in _fields(Path(path).read_bytes()):
            if field == _MODEL_PIECES:
                piece = dict(_fields(value))
                pieces.append(piece.get(_PIECE_TEXT, b"").decode("utf-8"))
                scores.append(struct.unpack("<f", piece[_PIECE_SCORE])[0] if _PIECE_SCORE in piece else 0.0)
                types.append(piece.get(_PIECE_TYPE, 1))
            elif field == _MODEL_TRAINER:
                trainer = {f: v for f, v in _fields(value) if isinstance(v, int)}
            elif field == _MODEL_NORMALIZER:
                normalizer = dict(_fields(value))
    except (IndexError, KeyError, UnicodeDecodeError, ValueError, struct.error) as e:
        raise ValueError(f"{path}: not a SentencePiece model ({type(e).__name__}: {e})") from e
    if not pieces:
        raise ValueError(f"{path}: a SentencePiece model with no pieces")
    name = normalizer.get(_NORM_NAME, b"nmt_nfkc")  # the proto's defaults where a field is absent
    return SentencePieceModel(
        pieces=pieces,
        scores=scores,
        types=types,
        model_type=MODEL_TYPES.get(trainer.get(_TRAINER_MODEL_TYPE, 1), "unknown"),
        normalizer=name.decode("utf-8") if isinstance(name, bytes) else str(name),
        add_dummy_prefix=bool(normalizer.get(_NORM_DUMMY_PREFIX, 1)),
        remove_extra_whitespaces=bool(normalizer.get(_NORM_EXTRA_WS, 1)),
        escape_whitespaces=bool(normalizer.get(_NORM_ESCAPE_WS, 1)),
        treat_whitespace_as_suffix=bool(trainer.get(_TRAINER_WS_SUFFIX, 0)),
        byte_fallback=bool(trainer.get(_TRAINER_BYTE_FALLBACK, 0)),
    )
