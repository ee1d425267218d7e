"""Base weights overwritten in place (same folder, same config, another seed): training must not be reused.

Seen before: the resume/reuse fingerprint held the base model's path, not its content; a re-run over new
weights said "nothing left to train", merged the old adapter into the new base and reported the old eval
loss. The fingerprint's settings (`model_settings`) now carry each weight file's size and mtime.
"""

from __future__ import annotations

import pytest
import torch


def _settings(model_dir):
    from transformers import AutoModelForCausalLM

    from slimtune.train.resume import model_settings

    return model_settings(AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32))


@pytest.mark.fault(
    "Base model weights overwritten in place",
    stage="packed_sft",
    expect="the resume fingerprint changes (old checkpoints are not resumed); an untouched folder keeps it",
)
def test_overwritten_base_weights_change_the_fingerprint(tmp_path, observe):
    from slimtune.models.tiny import save_tiny
    from slimtune.train.resume import _changed

    small = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2)
    base = save_tiny(tmp_path / "base", "llama", seed=0, **small)
    before = _settings(base)
    assert _settings(base) == before, "the same folder, untouched, must keep its fingerprint"
    save_tiny(base, "llama", seed=1, **small)  # same config and file sizes, other weights
    after = _settings(base)
    changed = _changed(before, after)
    observe("; ".join(changed)[:200])
    assert any(c.startswith("base_weights.") for c in changed), changed
