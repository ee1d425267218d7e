"""Hub push against a local fake Hub (tests/hub_server.py) driven by the real huggingface_hub client,
plus the model card and Ollama Modelfile text."""

from __future__ import annotations

import logging
import random
import re
import socket
from pathlib import Path

import huggingface_hub.constants as hf_constants
import pytest
import yaml
from hub_server import FakeHub

from slimtune.export.model_card import render_model_card, render_modelfile
from slimtune.export.push import PushError, PushResult, push_folder, resolve_token
from slimtune.models.tiny import CHAT_TEMPLATE

TOKEN = "hf_SlimtuneFakeToken0123456789abcdefXYZ"
REPO = "someone/tiny-chat-gguf"
BIG = 10 * 1024 * 1024 + 12_345  # just over the Hub's 10 MiB LFS threshold


@pytest.fixture
def hub(monkeypatch: pytest.MonkeyPatch):
    """A fake Hub that demands TOKEN, with huggingface_hub pointed at it for this test only."""
    with FakeHub(token=TOKEN) as server:
        monkeypatch.setenv("HF_ENDPOINT", server.endpoint)
        monkeypatch.setenv("HF_HUB_DISABLE_XET", "1")
        monkeypatch.setenv("HF_TOKEN", TOKEN)
        monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
        # huggingface_hub froze these two at import (conftest sets HF_HUB_OFFLINE=1 before that):
        # undo them for this test; monkeypatch restores both afterwards.
        monkeypatch.setattr(hf_constants, "HF_HUB_DISABLE_XET", True)
        monkeypatch.setattr(hf_constants, "HF_HUB_OFFLINE", False)
        yield server


@pytest.fixture
def export_dir(tmp_path: Path) -> dict[str, Path]:
    """What an export produces: a card, a Modelfile, a small GGUF, a >10 MiB file and a nested config."""
    rng = random.Random(0)
    files = {
        "README.md": render_model_card(
            repo_id=REPO,
            base_model="Qwen/Qwen2.5-0.5B",
            quants=[{"file": "tiny-q8_0.gguf", "method": "q8_0", "size_bytes": 4100}],
        ),
        "Modelfile": render_modelfile("tiny-q8_0.gguf", CHAT_TEMPLATE, eos_token="<|im_end|>"),
    }
    out: dict[str, Path] = {}
    for name, text in files.items():
        out[name] = tmp_path / name
        out[name].write_text(text)
    out["tiny-q8_0.gguf"] = tmp_path / "tiny-q8_0.gguf"
    out["tiny-q8_0.gguf"].write_bytes(b"GGUF" + rng.randbytes(4096))
    out["shards/big.bin"] = tmp_path / "big.bin"
    out["shards/big.bin"].write_bytes(rng.randbytes(BIG))
    out["config/export.json"] = tmp_path / "export.json"
    out["config/export.json"].write_text('{"method": "q8_0"}\n')
    return out


def _push(files: dict[str, Path], **overrides) -> PushResult:
    kwargs = dict(
        private=True,
        revision=None,
        token=TOKEN,
        commit_message="Add GGUF export",
        max_attempts=3,
        backoff_s=0.01,
    )
    kwargs.update(overrides)
    return push_folder(files, REPO, **kwargs)


def _assert_landed(hub: FakeHub, files: dict[str, Path], result: PushResult, revision: str = "main") -> None:
    """Exactly one commit beyond the Hub's initial one, holding every file byte for byte."""
    commits = hub.commits(REPO, revision)
    assert [c.summary for c in commits] == ["initial commit", "Add GGUF export"]
    assert result.commit_oid == commits[-1].oid and result.commit_oid in result.commit_url
    stored = hub.files(REPO, revision)
    assert set(stored) == set(files) | {".gitattributes"}
    for path, local in files.items():
        assert stored[path] == local.read_bytes(), path


def test_push_is_one_commit_with_identical_bytes(hub: FakeHub, export_dir: dict[str, Path]):
    result = _push(export_dir)

    _assert_landed(hub, export_dir, result)
    assert len(hub.requests_to(r"/commit/main$")) == 1
    assert result.attempts == 1 and result.revision == "main" and result.repo_id == REPO
    assert {f.path_in_repo: f.size_bytes for f in result.files} == {
        p: local.stat().st_size for p, local in export_dir.items()
    }
    assert hub.repos[REPO].private
    # The >10 MiB file and the .gguf went through LFS (PUT + verify), the text files inline in the commit.
    puts = hub.requests_to(r"^/_fake_s3/", "PUT")
    assert sorted(len(r.body) for r in puts) == [4100, BIG]
    assert len(hub.verified) == 2
    assert hub.unknown == []


def test_push_to_a_new_branch_leaves_main_alone(hub: FakeHub, export_dir: dict[str, Path]):
    result = _push(export_dir, revision="q8-export")

    _assert_landed(hub, export_dir, result, revision="q8-export")
    assert result.revision == "q8-export"
    assert [c.summary for c in hub.commits(REPO, "main")] == ["initial commit"]


def test_repush_of_unchanged_files_adds_no_commit(hub: FakeHub, export_dir: dict[str, Path]):
    first = _push(export_dir)
    second = _push(export_dir)

    assert second.commit_oid == first.commit_oid
    assert len(hub.commits(REPO)) == 2
    assert len(hub.requests_to(r"^/_fake_s3/", "PUT")) == 2  # LFS content is not uploaded again


@pytest.mark.parametrize("path", [r"^/api/repos/create$", r"/commit/main$"])
def test_503_then_success_is_retried(
    hub: FakeHub, export_dir: dict[str, Path], path: str, caplog: pytest.LogCaptureFixture
):
    hub.fail_next(path, 503, times=1)
    with caplog.at_level(logging.WARNING, logger="slimtune.export.push"):
        result = _push(export_dir)

    assert result.attempts == 2
    _assert_landed(hub, export_dir, result)
    assert len(hub.requests_to(r"/commit/main$")) == (2 if "commit" in path else 1)
    assert any("attempt 1/3 failed" in r.getMessage() and "503" in r.getMessage() for r in caplog.records)


def test_dropped_connection_is_retried(hub: FakeHub, export_dir: dict[str, Path]):
    hub.fail_next(r"^/api/repos/create$", None, times=2)
    result = _push(export_dir)

    assert result.attempts == 3
    _assert_landed(hub, export_dir, result)


def test_lost_commit_answer_does_not_commit_twice(hub: FakeHub, export_dir: dict[str, Path]):
    hub.fail_next(r"/commit/main$", None, after=True)  # the Hub commits, the answer never arrives
    result = _push(export_dir)

    assert result.attempts == 2
    _assert_landed(hub, export_dir, result)


def test_retries_stop_after_max_attempts(hub: FakeHub, export_dir: dict[str, Path]):
    hub.fail_next(r"/commit/main$", 502, times=10)
    with pytest.raises(PushError) as info:
        _push(export_dir, max_attempts=3)

    assert info.value.attempts == 3 and info.value.status == 502
    assert len(hub.requests_to(r"/commit/main$")) == 3
    assert "failed 3 time(s)" in str(info.value)
    assert [c.summary for c in hub.commits(REPO)] == ["initial commit"]


def test_unreachable_hub_is_retried_then_explained(
    monkeypatch: pytest.MonkeyPatch, hub: FakeHub, export_dir: dict[str, Path]
):
    with socket.socket() as sock:  # a port nobody listens on once this socket is closed
        sock.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{sock.getsockname()[1]}"
    monkeypatch.setenv("HF_ENDPOINT", dead)
    with pytest.raises(PushError) as info:
        _push(export_dir, max_attempts=2)

    assert info.value.attempts == 2 and info.value.status is None
    assert dead in str(info.value) and "re-run later" in str(info.value)


@pytest.mark.parametrize(("status", "advice"), [(401, "HF_TOKEN"), (403, "write access"), (404, "repo_id")])
def test_client_errors_fail_at_once_without_the_token(
    hub: FakeHub,
    export_dir: dict[str, Path],
    status: int,
    advice: str,
    caplog: pytest.LogCaptureFixture,
    capsys: pytest.CaptureFixture[str],
):
    # The error body echoes the Authorization header, as a careless proxy might: it must not reach the user.
    hub.fail_next(r"^/api/repos/create$", status, times=5, body="denied for {authorization} on this repo")
    with caplog.at_level(logging.DEBUG), pytest.raises(PushError) as info:
        _push(export_dir, max_attempts=5)

    err = info.value
    assert err.attempts == 1 and err.status == status
    assert len(hub.requests_to(r"^/api/repos/create$")) == 1
    assert advice in str(err) and "denied for Bearer ***" in str(err)
    assert err.__cause__ is None and err.__suppress_context__  # the raw cause quotes the token
    captured = capsys.readouterr()
    for text in (str(err), repr(err), caplog.text, captured.out, captured.err):
        assert TOKEN not in text
    assert REPO not in hub.repos and not hub.requests_to(r"/commit/")


def test_wrong_token_is_a_401_that_names_the_fix(
    hub: FakeHub, export_dir: dict[str, Path], caplog: pytest.LogCaptureFixture
):
    wrong = "hf_WrongTokenForThisFakeHub9876543210ab"
    with caplog.at_level(logging.DEBUG), pytest.raises(PushError) as info:
        _push(export_dir, token=wrong)

    assert info.value.status == 401 and info.value.attempts == 1
    assert "HF_TOKEN" in str(info.value) and "hf-token" in str(info.value)
    for text in (str(info.value), caplog.text):
        assert wrong not in text and TOKEN not in text


def test_token_stays_out_of_everything_on_success(
    hub: FakeHub,
    export_dir: dict[str, Path],
    caplog: pytest.LogCaptureFixture,
    capsys: pytest.CaptureFixture[str],
):
    hub.fail_next(r"/commit/main$", 503, times=1, body="busy, retry with {authorization}")
    with caplog.at_level(logging.DEBUG):
        result = _push(export_dir)

    assert result.attempts == 2
    captured = capsys.readouterr()
    for text in (repr(result), caplog.text, captured.out, captured.err):
        assert TOKEN not in text
    # The token travels only as the Authorization header of Hub API calls: never in a URL or a body, and
    # never to the (presigned) storage URL.
    api_calls = [r for r in hub.requests if not r.path.startswith("/_fake_s3/")]
    assert api_calls and all(r.headers.get("authorization") == f"Bearer {TOKEN}" for r in api_calls)
    for r in hub.requests:
        assert TOKEN not in r.path + r.query and TOKEN.encode() not in r.body
        if r.path.startswith("/_fake_s3/"):
            assert "authorization" not in r.headers


def test_offline_mode_fails_at_once_and_says_why(
    hub: FakeHub, export_dir: dict[str, Path], monkeypatch: pytest.MonkeyPatch
):
    monkeypatch.setattr(hf_constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(PushError) as info:
        _push(export_dir)

    assert info.value.attempts == 1 and "HF_HUB_OFFLINE" in str(info.value)
    assert hub.requests == []


def test_invalid_card_metadata_fails_before_any_upload(hub: FakeHub, export_dir: dict[str, Path]):
    export_dir["README.md"].write_text("---\nlicense: [unclosed\n---\n# card\n")
    with pytest.raises(PushError) as info:
        _push(export_dir)

    assert info.value.attempts == 1 and "Invalid metadata in README.md" in str(info.value)
    assert not hub.requests_to(r"^/_fake_s3/") and not hub.requests_to(r"/commit/")


def test_bad_arguments_are_all_listed(tmp_path: Path):
    with pytest.raises(ValueError) as info:
        push_folder(
            {"../escape.gguf": tmp_path / "missing.gguf"},
            "no-namespace",
            private=False,
            revision=None,
            token=None,
            commit_message=" ",
            max_attempts=0,
        )
    text = str(info.value)
    for fragment in (
        "repo_id 'no-namespace'",
        "commit_message",
        "max_attempts",
        "'../escape.gguf'",
        "missing.gguf",
    ):
        assert fragment in text


def test_resolve_token_prefers_env(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("HF_TOKEN", f"  {TOKEN}\n")
    monkeypatch.setenv("SLIMTUNE_HF_TOKEN_BLOCK", "a-block-that-is-never-read")
    assert resolve_token() == TOKEN


def test_resolve_token_reads_the_prefect_secret_block(monkeypatch: pytest.MonkeyPatch, prefect_harness):
    """Against a real (ephemeral) Prefect API, shared through conftest's session fixture."""
    from prefect.blocks.system import Secret

    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.setenv("SLIMTUNE_HF_TOKEN_BLOCK", "slimtune-test-hf-token")
    assert resolve_token() is None  # no such block yet: not an error
    Secret(value="hf_FromPrefectBlock0123456789abcdef").save("slimtune-test-hf-token", overwrite=True)
    assert resolve_token() == "hf_FromPrefectBlock0123456789abcdef"


# ---------------------------------------------------------------- model card and Modelfile


def test_model_card_lists_what_was_trained_and_how_to_run_it():
    quants = [
        {"file": "chat-q4_k_m.gguf", "method": "q4_k_m", "size_bytes": 3 * 2**30 + 2**29},
        {"file": "chat-f16.gguf", "method": "f16", "size_bytes": 700 * 2**20},
    ]
    card = render_model_card(
        repo_id="someone/Chat-GGUF",
        base_model="Qwen/Qwen2.5-0.5B",
        quants=quants,
        datasets=["someone/chats"],
        lora={"r": 16, "alpha": 32, "target_modules": ["q_proj", "v_proj"]},
        metrics={"final_loss": 1.234567, "peak_gib": 3.5},
        license_id="apache-2.0",
        tags=["qwen2"],
    )
    front, body = re.fullmatch(r"---\n(.*?)\n---\n(.*)", card, re.S).groups()
    meta = yaml.safe_load(front)
    assert meta["base_model"] == "Qwen/Qwen2.5-0.5B" and meta["license"] == "apache-2.0"
    assert meta["datasets"] == ["someone/chats"]
    assert {"gguf", "lora", "qwen2"} <= set(meta["tags"])
    for heading in (
        "## Base model",
        "## Dataset",
        "## LoRA configuration",
        "## Training metrics",
        "## Files",
        "## Usage",
    ):
        assert heading in body
    assert "| r | 16 |" in body and "| target_modules | q_proj, v_proj |" in body
    assert "| final_loss | 1.235 |" in body
    assert f"| chat-q4_k_m.gguf | q4_k_m | 3.50 GiB | {3 * 2**30 + 2**29} |" in body
    assert "| chat-f16.gguf | f16 | 700.00 MiB |" in body
    assert "llama-cli -m chat-q4_k_m.gguf" in body
    assert "ollama create chat-gguf -f Modelfile" in body


def test_model_card_keeps_local_paths_out_of_the_metadata(tmp_path: Path):
    card = render_model_card(
        repo_id="someone/x",
        base_model="builtin:tiny-llama",
        datasets=[str(tmp_path)],
        quants=[{"file": "x.gguf", "method": "q8_0", "size_bytes": 10}],
    )
    meta = yaml.safe_load(card.split("---\n")[1])
    assert "base_model" not in meta and "datasets" not in meta and "license" not in meta
    assert "`builtin:tiny-llama`" in card and "| x.gguf | q8_0 | 10 B | 10 |" in card
    with pytest.raises(ValueError, match=r"quants\[0\] lacks size_bytes"):
        render_model_card(repo_id="someone/x", base_model="b", quants=[{"file": "x.gguf", "method": "q8_0"}])


def _render_go_template(template: str, messages: list[dict[str, str]]) -> str:
    """Evaluate the small Go-template subset the Modelfile uses: text, {{ .Role }}, {{ .Content }},
    {{ range .Messages }} ... {{ end }} and the {{- / -}} whitespace trims. Anything else fails the test."""
    parts = re.split(r"(\{\{-?\s*.*?\s*-?\}\})", template)
    for i, part in enumerate(parts):  # apply trims to the neighbouring text
        if part.startswith("{{-") and i > 0:
            parts[i - 1] = parts[i - 1].rstrip()
        if part.endswith("-}}") and i + 1 < len(parts):
            parts[i + 1] = parts[i + 1].lstrip()
    out: list[str] = []
    body: list[str | tuple[str]] = []  # a 1-tuple names a message field
    depth = 0
    for part in parts:
        action = re.fullmatch(r"\{\{-?\s*(.*?)\s*-?\}\}", part)
        name = action.group(1) if action else None
        if name == "range .Messages":
            depth += 1
        elif name == "end":
            depth -= 1
            out += [m[p[0]] if isinstance(p, tuple) else p for m in messages for p in body]
            body = []
        elif name is not None:
            assert depth == 1, f"{name} outside range"
            body.append(({".Role": "role", ".Content": "content"}[name],))  # KeyError: unsupported
        else:
            (body if depth else out).append(part)
    assert depth == 0
    return "".join(out)


def _tokenizer_with(template: str):
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(models.WordLevel({"x": 0}, unk_token="x")),
        chat_template=template,
        eos_token="<|im_end|>",
    )


def test_modelfile_template_matches_the_chat_template():
    text = render_modelfile(
        "tiny-q4_k_m.gguf",
        CHAT_TEMPLATE,
        eos_token="<|im_end|>",
        parameters={"temperature": 0.7, "num_ctx": 2048},
    )
    assert "FROM ./tiny-q4_k_m.gguf\n" in text
    assert 'PARAMETER stop "<|im_end|>"' in text and text.count("PARAMETER stop") == 1
    assert "PARAMETER temperature 0.7" in text and "PARAMETER num_ctx 2048" in text
    template = re.search(r'TEMPLATE """(.*?)"""', text, re.S).group(1)
    chat = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Name a colour."},
        {"role": "assistant", "content": "Teal."},
        {"role": "user", "content": "Another one?"},
    ]
    expected = _tokenizer_with(CHAT_TEMPLATE).apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    assert _render_go_template(template, chat) == expected


def test_modelfile_keeps_a_templates_default_system_prompt():
    qwen_like = (
        "{% if messages[0]['role'] != 'system' %}"
        "{{ '<|im_start|>system\\nYou are terse.<|im_end|>\\n' }}{% endif %}"
        "{% for m in messages %}"
        "{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
    )
    text = render_modelfile("m.gguf", qwen_like, eos_token="<|endoftext|>")
    assert 'SYSTEM """You are terse."""' in text and "TEMPLATE" in text
    assert 'PARAMETER stop "<|endoftext|>"' in text and 'PARAMETER stop "<|im_end|>"' in text
    # Ollama puts SYSTEM first in .Messages when the chat has no system turn: same text as the template.
    chat = [{"role": "user", "content": "Hi"}]
    template = re.search(r'TEMPLATE """(.*?)"""', text, re.S).group(1)
    expected = _tokenizer_with(qwen_like).apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    assert _render_go_template(template, [{"role": "system", "content": "You are terse."}, *chat]) == expected


def test_modelfile_without_a_recognisable_template_has_no_template():
    llama3_like = (
        "{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n"
        "{{ m['content'] }}<|eot_id|>{% endfor %}"
    )
    text = render_modelfile("m.gguf", llama3_like, eos_token="<|eot_id|>", bos_token="<|begin_of_text|>")
    assert "TEMPLATE" not in text.replace("no TEMPLATE", "") and "matches none of" in text
    assert 'PARAMETER stop "<|eot_id|>"' in text and text.count("PARAMETER stop") == 1
    assert "# The tokenizer has no chat template" in render_modelfile("m.gguf", None)
