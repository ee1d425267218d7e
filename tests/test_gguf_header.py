"""The GGUF header reader that the export's completeness check uses agrees with gguf's own reader."""

from __future__ import annotations

import gguf
import numpy as np
import pytest

from slimtune.export.gguf_header import GGUFHeaderError, read_header
from slimtune.export.gguf_verify import GGUFVerifyError, check_complete


@pytest.fixture
def written(tmp_path):
    path = tmp_path / "m.gguf"
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_uint32("llama.block_count", 3)
    writer.add_float32("llama.rope.freq_base", 10000.5)
    writer.add_bool("tokenizer.ggml.add_bos_token", True)
    writer.add_string("general.name", "naïve ✓")
    writer.add_token_list(["a", "b", "<s>", "ü"])
    writer.add_token_scores([0.0, -1.5, 2.25, 3.0])
    writer.add_tensor("token_embd.weight", np.arange(64 * 4, dtype=np.float32).reshape(4, 64))
    writer.add_tensor("blk.0.attn_q.weight", np.ones((32, 64), dtype=np.float16))
    writer.add_tensor(
        "output.weight",
        gguf.quants.quantize(
            np.linspace(-1, 1, 64 * 8, dtype=np.float32).reshape(8, 64), gguf.GGMLQuantizationType.Q8_0
        ),
        raw_dtype=gguf.GGMLQuantizationType.Q8_0,
    )
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_the_header_equals_ggufs_reader(written):
    ours = read_header(written)
    theirs = gguf.GGUFReader(written)
    kv = {k: f.contents() for k, f in theirs.fields.items() if not k.startswith("GGUF.")}  # its pseudo-fields
    assert ours.kv == kv and len(kv) == 7
    assert [(t.name, t.shape, t.type, t.offset) for t in ours.tensors] == [
        (t.name, tuple(int(d) for d in t.shape), t.tensor_type, t.data_offset - theirs.data_offset)
        for t in theirs.tensors
    ]
    assert [t.nbytes for t in ours.tensors] == [int(t.n_bytes) for t in theirs.tensors]
    assert ours.data_offset == theirs.data_offset
    assert ours.data_end == written.stat().st_size


def test_a_cut_file_is_refused_naming_the_file(written, tmp_path):
    whole = written.read_bytes()
    header_end = read_header(written).data_offset
    for keep in (len(whole) - 1, header_end + 10, header_end - 10, 30):
        cut = tmp_path / f"cut-{keep}.gguf"
        cut.write_bytes(whole[:keep])
        with pytest.raises(GGUFVerifyError, match=f"cut-{keep}.gguf \\({keep} bytes\\) is truncated or corrupt"):
            check_complete(cut)
    assert check_complete(written) == [written]
    (tmp_path / "not.gguf").write_bytes(b"PK\x03\x04" + whole[4:])
    with pytest.raises(GGUFHeaderError, match="not a GGUF file"):
        read_header(tmp_path / "not.gguf")
