"""The tokenizer and the data as the run will see them, checked before any model loads.

`run` met these only in training, after the model was on the GPU: a tokenizer with more tokens than the
model has embedding rows (an IndexError at the first batch holding one of them) and data whose mixing or
filtering leaves nothing to train on. The tokenizer is loaded and the data read exactly as the flow's
`prepare_data` does (`slimtune.data.load_examples`), so the counts are the run's own.
"""

from __future__ import annotations

from pathlib import Path

from slimtune.core.bounded import clip
from slimtune.spec.schema import DataSpec, PipelineSpec

# Data larger than this is not read by the checks: tokenizing runs at ~0.3 MB/s on one busy CPU core
# (deployments/data/tiny_chat.jsonl, 51 KB in 0.18 s), so 8 MB is ~30 s of `validate`. Larger data is
# checked by the run's own `prepare_data`, which also stops with exit 2 before the model loads.
_DATA_CHECK_BYTES = 8 * 1024**2


def tokenizer_and_data_problems(spec: PipelineSpec) -> list[str]:
    """One line per problem of the tokenizer (against the embedding rows of config.json) and of the data.

    A Hub model is checked too: its config.json and tokenizer files come without the weights."""
    from slimtune.models.source import ModelSourceError, read_config, tokenizer_files_dir

    folder = tokenizer_files_dir(spec.model)
    if folder is None:  # a Hub model out of reach: the run reports the download's own error
        return []
    from transformers import AutoTokenizer

    try:  # as prepare_data loads it
        tokenizer = AutoTokenizer.from_pretrained(folder, trust_remote_code=spec.model.trust_remote_code)
    except Exception as e:  # whatever transformers raises, the run would stop on it
        reason = clip(" ".join(str(e).split()), 300) or type(e).__name__
        return [f"model.name_or_path: cannot load the tokenizer in {folder} ({reason}); download the model again"]
    try:
        config = read_config(folder)
    except ModelSourceError as e:
        return [str(e)]
    # the embedding table has vocab_size rows (a multimodal config keeps it in text_config)
    rows = config.get("vocab_size") or (config.get("text_config") or {}).get("vocab_size")
    problems = []
    if isinstance(rows, int) and len(tokenizer) > rows:
        problems.append(
            f"model.name_or_path: the tokenizer in {folder} has {len(tokenizer)} tokens (added tokens included) "
            f"but the model has {rows} embedding rows (config.json vocab_size), so training fails on "
            "the first token past them; slimtune does not resize embeddings: use the model's own tokenizer files"
        )
    return problems + _example_problems(spec.data, tokenizer)


def _example_problems(data: DataSpec, tokenizer) -> list[str]:
    """Whether the data leaves examples to train on after parsing, overlong dropping, the eval split and the
    source weights; local files up to `_DATA_CHECK_BYTES` only (a Hub dataset would be downloaded)."""
    files = [Path(f) for f in data.files()]
    if not all(f.is_file() for f in files) or sum(f.stat().st_size for f in files) > _DATA_CHECK_BYTES:
        return []
    from slimtune.data import DataError, load_examples

    try:
        load_examples(data, tokenizer)
    except DataError as e:
        return [str(e)]
    return []
