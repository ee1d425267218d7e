"""A GGUF's `general.name` is the run's name, k-quants (made by llama.cpp from an f16 intermediate) included:
llama.cpp and Ollama display it, and the merged model's folder is always called "merged"."""

from __future__ import annotations

import shutil

import gguf

from slimtune.models.tiny import BUILTIN_PREFIX, ensure_builtin
from slimtune.spec.schema import PipelineSpec
from slimtune.tasks.gguf_convert_and_push import _convert


def test_every_gguf_is_named_after_the_run(tmp_path):
    merged = tmp_path / "support-bot-v2" / "merged"
    shutil.copytree(ensure_builtin(BUILTIN_PREFIX + "llama"), merged)
    spec = PipelineSpec.model_validate(
        {
            "name": "support-bot-v2",
            "output_dir": str(tmp_path),
            "data": {"path": "unused.jsonl"},
            "export": {"gguf": ["f16", "q4_k_m"]},
        }
    )
    written = _convert(spec, merged, tmp_path / "gguf")
    names = {path.name: gguf.GGUFReader(path).fields["general.name"].contents() for path in written}
    assert names == {"support-bot-v2-f16.gguf": "support-bot-v2", "support-bot-v2-q4_k_m.gguf": "support-bot-v2"}
