"""Corrupted inputs: a truncated safetensors shard, an adapter that does not fit its base, a GGUF cut short.

Each must fail with our own error naming the file and what to do, never with a library's exception as
the only message.
"""

from __future__ import annotations

import shutil

import pytest
import torch
from faultlib import spec_dict
from safetensors.torch import load_file, save_file

from slimtune.export.gguf_verify import GGUFVerifyError, verify_gguf
from slimtune.merge import merge_adapter
from slimtune.merge.errors import MergeError
from slimtune.models.tiny import ensure_builtin
from slimtune.spec.schema import parse_spec
from slimtune.tasks.load_4bit import load_4bit

_OURS = ("slimtune.",)  # exception types defined by slimtune (module path), not by a library


def _is_ours(exc: BaseException) -> bool:
    return type(exc).__module__.startswith(_OURS)


@pytest.fixture
def truncated_base(tmp_path):
    base = tmp_path / "base"
    shutil.copytree(ensure_builtin("builtin:tiny-llama"), base)
    shard = base / "model.safetensors"
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) // 2])
    return base, shard


@pytest.mark.fault(
    "Corrupted input: truncated safetensors shard",
    stage="load_4bit",
    expect="our error naming the shard and saying it is truncated",
)
def test_truncated_base_shard_at_load(truncated_base, tmp_path, observe):
    base, shard = truncated_base
    spec = parse_spec(spec_dict(tmp_path / "runs", model={"name_or_path": str(base), "device": "cpu"}))
    with pytest.raises(Exception) as err:
        load_4bit(spec)
    observe(f"{type(err.value).__module__}.{type(err.value).__name__}: {str(err.value)[:120]}")
    assert _is_ours(err.value) and str(shard) in str(err.value), repr(err.value)


@pytest.mark.fault(
    "Corrupted input: truncated safetensors shard",
    stage="dequant_merge",
    expect="MergeError/OSError naming the shard; nothing published",
)
def test_truncated_base_shard_at_merge(truncated_base, reference_run, tmp_path, observe):
    base, shard = truncated_base
    out = tmp_path / "merged"
    with pytest.raises((MergeError, OSError)) as err:
        merge_adapter(base, reference_run["run_dir"] / "adapter", out, device="cpu")
    observe(f"{type(err.value).__name__}: {str(err.value).replace(str(tmp_path), '…')[:140]}")
    assert str(shard) in str(err.value) and "truncated" in str(err.value)
    assert not out.exists() and not list(tmp_path.glob(".merged*"))


@pytest.mark.fault(
    "Corrupted input: adapter shapes do not match the base",
    stage="dequant_merge",
    expect="AdapterMismatchError listing the tensor and both shapes, before writing",
)
def test_adapter_shape_mismatch(reference_run, tmp_path, observe):
    adapter = tmp_path / "adapter"
    shutil.copytree(reference_run["run_dir"] / "adapter", adapter)
    tensors = load_file(adapter / "adapter_model.safetensors")
    key = next(k for k in sorted(tensors) if k.endswith("q_proj.lora_B.weight"))
    tensors[key] = torch.zeros(tensors[key].shape[0] // 2, tensors[key].shape[1])
    save_file(tensors, adapter / "adapter_model.safetensors")
    out = tmp_path / "merged"
    with pytest.raises(MergeError) as err:
        merge_adapter(ensure_builtin("builtin:tiny-llama"), adapter, out, device="cpu")
    observe(f"{type(err.value).__name__}: {str(err.value).splitlines()[-1].strip()[:140]}")
    module = key.removeprefix("base_model.model.").split(".lora_B")[0]
    assert f"{module}.weight" in str(err.value) and "base shape" in str(err.value)
    assert not out.exists() and not list(tmp_path.glob(".merged*"))


@pytest.mark.fault(
    "Corrupted input: GGUF cut short",
    stage="gguf_convert_and_push",
    expect="GGUFVerifyError naming the file and its size, advising to re-run the conversion",
)
def test_gguf_cut_short(reference_run, tmp_path, observe):
    gguf = tmp_path / "faults-f16.gguf"
    data = (reference_run["run_dir"] / "gguf" / "faults-f16.gguf").read_bytes()
    gguf.write_bytes(data[: len(data) * 2 // 3])
    with pytest.raises(GGUFVerifyError) as err:
        verify_gguf(gguf, reference_run["run_dir"] / "merged", ["hello"])
    observe(f"GGUFVerifyError: {str(err.value).replace(str(tmp_path), '…')[:140]}")
    assert str(gguf) in str(err.value) and "re-run the conversion" in str(err.value)
