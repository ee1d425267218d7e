"""Push exported files to the Hugging Face Hub as one commit; retry transient failures; never leak the token.

One commit per push keeps the repo consistent: a reader never sees a model card that names a GGUF file
which has not arrived yet. A retry re-runs the whole sequence (create repo, create branch, commit); it is
safe because each step is idempotent: the repo and branch calls accept "already exists", LFS objects the
Hub already holds are skipped, and `create_commit` drops files whose remote hash already matches, so a
commit whose answer was lost is not committed twice.

Why a retry of our own, when huggingface_hub has `http_backoff`: in huggingface_hub 2.4 only the preupload
and LFS calls go through it; `create_repo` and the commit POST do not. Measured against the fake Hub of
tests/hub_server.py with max_attempts=1: one 503, or one dropped connection, on /api/repos/create or on
/commit/main fails the push after a single request. The client's opt-in `retry_on_error` for the commit
POST would commit twice when the Hub committed but the answer was lost (its own docstring says so).
"""

from __future__ import annotations

import importlib
import logging
import os
import re
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import TYPE_CHECKING

from slimtune.core.exception_chain import exception_chain

if TYPE_CHECKING:
    from huggingface_hub import CommitInfo, HfApi

logger = logging.getLogger(__name__)

DEFAULT_TOKEN_BLOCK = "hf-token"
# 408/429 are the Hub's "try again later" answers besides 5xx (huggingface_hub's http_backoff uses 429 and 5xx).
_RETRIABLE_STATUS = frozenset({408, 429, 500, 502, 503, 504})
_MAX_BACKOFF_S = 60.0  # cap the doubling: 1, 2, 4, ... 60 s
_REPO_ID_RE = re.compile(r"[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*")
# Hub tokens look like "hf_" + 34 letters/digits; scrub any such string, not only the one we hold.
_HF_TOKEN_RE = re.compile(r"hf_[A-Za-z0-9]{16,}")
_BEARER_RE = re.compile(r"(?i)\b(bearer\s+)[^\s'\"]+")
_REDACTED = "***"
_MDN_LINK_RE = re.compile(r"\s*For more information check: \S+")  # httpx boilerplate in every HTTP error


@dataclass(frozen=True)
class PushedFile:
    """One file of the commit: where it lives in the repo and how many bytes it holds."""

    path_in_repo: str
    size_bytes: int


@dataclass(frozen=True)
class PushResult:
    """What a push produced; holds no credentials, so it is safe to return from a Prefect task."""

    repo_id: str
    revision: str
    commit_oid: str
    commit_url: str
    files: tuple[PushedFile, ...]
    attempts: int


class PushError(RuntimeError):
    """A push that failed for good; the message says what to do and never contains the token.

    Attributes:
        status: The HTTP status of the last failure, or None for network errors and local problems.
        attempts: How many times the push was tried.
    """

    def __init__(self, message: str, *, status: int | None, attempts: int):
        super().__init__(message)
        self.status = status
        self.attempts = attempts


def resolve_token() -> str | None:
    """The Hub token: env `HF_TOKEN`, else the Prefect Secret block named by `SLIMTUNE_HF_TOKEN_BLOCK`.

    Returns None when neither is set, so huggingface_hub falls back to a token saved by `hf auth login`.
    A missing block, or a Prefect API that cannot be reached, is not an error: the push reports a 401
    with instructions if no token works.
    """
    token = os.environ.get("HF_TOKEN", "").strip()
    if token:
        return token
    block = _token_block_name()
    try:
        from prefect.blocks.system import Secret
        from prefect.exceptions import ObjectNotFound

        value = Secret.load(block).get()
    except ValueError as exc:
        if isinstance(exc.__cause__, ObjectNotFound):  # Prefect wraps "no such block" in a ValueError
            logger.debug("no Prefect Secret block %r; pushing with huggingface_hub's saved token, if any", block)
            return None
        raise
    except Exception as exc:
        logger.warning("could not read Prefect Secret block %r (%s); pushing without it", block, type(exc).__name__)
        return None
    if not isinstance(value, str) or not value.strip():
        raise ValueError(
            f"Prefect Secret block {block!r} must hold the Hub token as a non-empty string; "
            "re-create it with Secret(value='hf_...').save(name, overwrite=True)"
        )
    return value.strip()


def push_folder(
    files: Mapping[str, Path],
    repo_id: str,
    *,
    private: bool,
    revision: str | None,
    token: str | None,
    commit_message: str,
    max_attempts: int = 5,
    backoff_s: float = 1.0,
) -> PushResult:
    """Create `repo_id` if needed and upload `files` (path in repo -> local file) as exactly one commit.

    Args:
        files: Path inside the repo (POSIX, relative) -> local file.
        repo_id: "namespace/name" of the model repo.
        private: Visibility when the repo is created; an existing repo keeps its visibility.
        revision: Branch to commit to (created from main if missing); None means main.
        token: Hub token (see `resolve_token`); None uses huggingface_hub's saved login.
        commit_message: Summary line of the commit.
        max_attempts: Tries in all for 5xx/408/429 answers and network errors.
        backoff_s: Wait before the second try; doubles each time, capped at 60 s.

    Raises:
        ValueError: The arguments are unusable (each problem is listed with its fix).
        PushError: The Hub refused the push, or it kept failing; the message is free of the token.
    """
    from huggingface_hub import HfApi, get_token

    sizes = _validate(files, repo_id, commit_message, max_attempts, backoff_s)
    secrets = tuple(s for s in (token, get_token()) if s)
    api = HfApi(endpoint=_endpoint(), token=token, library_name="slimtune")
    branch = revision or "main"
    logger.info("pushing %d file(s), %d bytes, to %s@%s", len(sizes), sum(sizes.values()), repo_id, branch)
    for attempt in range(1, max_attempts + 1):
        try:
            info = _push_once(api, files, repo_id, private=private, revision=revision, commit_message=commit_message)
        except Exception as exc:
            status, retriable = _classify(exc)
            detail = _redact(_describe(exc), secrets)
            if not retriable or attempt == max_attempts:
                raise PushError(
                    _advice(status, retriable, detail, repo_id, branch, attempt),
                    status=status,
                    attempts=attempt,
                ) from None  # the cause may quote the token
            wait = min(backoff_s * 2 ** (attempt - 1), _MAX_BACKOFF_S)
            logger.warning(
                "push to %s: attempt %d/%d failed (%s); retrying in %.1f s",
                repo_id,
                attempt,
                max_attempts,
                detail,
                wait,
            )
            time.sleep(wait)
            continue
        pushed = tuple(PushedFile(path, sizes[path]) for path in files)
        logger.info(
            "pushed %d file(s), %d bytes, to %s@%s in commit %s (attempt %d)",
            len(pushed),
            sum(sizes.values()),
            repo_id,
            branch,
            info.oid,
            attempt,
        )
        return PushResult(repo_id, branch, info.oid, info.commit_url, pushed, attempt)
    raise AssertionError("unreachable: the loop returns or raises")


def _push_once(
    api: HfApi,
    files: Mapping[str, Path],
    repo_id: str,
    *,
    private: bool,
    revision: str | None,
    commit_message: str,
) -> CommitInfo:
    from huggingface_hub import CommitOperationAdd

    api.create_repo(repo_id, private=private, exist_ok=True)
    if revision not in (None, "main"):
        api.create_branch(repo_id, branch=revision, exist_ok=True)
    # Fresh operations every attempt: huggingface_hub mutates them and refuses to commit one twice.
    operations = [CommitOperationAdd(path_in_repo=path, path_or_fileobj=str(local)) for path, local in files.items()]
    return api.create_commit(repo_id, operations, commit_message=commit_message, revision=revision)


def _endpoint() -> str:
    """Read HF_ENDPOINT now: huggingface_hub.constants froze it at import, which is too early for tests."""
    from huggingface_hub import constants

    return (os.environ.get("HF_ENDPOINT") or constants.ENDPOINT).rstrip("/")


def _token_block_name() -> str:
    return os.environ.get("SLIMTUNE_HF_TOKEN_BLOCK") or DEFAULT_TOKEN_BLOCK


def _validate(
    files: Mapping[str, Path], repo_id: str, commit_message: str, max_attempts: int, backoff_s: float
) -> dict[str, int]:
    """Collect every problem with the arguments into one message; return each file's size."""
    problems: list[str] = []
    if not _REPO_ID_RE.fullmatch(repo_id or ""):
        problems.append(f"repo_id {repo_id!r} must be 'namespace/name' (letters, digits, '-', '_', '.')")
    if not commit_message or not commit_message.strip():
        problems.append("commit_message is empty; give the commit a summary line")
    if max_attempts < 1:
        problems.append(f"max_attempts is {max_attempts}; use 1 or more")
    if backoff_s < 0:
        problems.append(f"backoff_s is {backoff_s}; use 0 or more seconds")
    if not files:
        problems.append("files is empty; pass at least one file (path in repo -> local path)")
    sizes: dict[str, int] = {}
    for path_in_repo, local in files.items():
        pure = PurePosixPath(path_in_repo)
        if not path_in_repo or "\\" in path_in_repo or pure.is_absolute() or ".." in pure.parts:
            problems.append(
                f"files key {path_in_repo!r} must be a relative POSIX path inside the repo, like "
                "'model-q4_k_m.gguf' or 'sub/dir/file'"
            )
        local = Path(local)
        if not local.is_file():
            problems.append(f"files[{path_in_repo!r}] = {str(local)!r} is not an existing file; export it first")
        else:
            sizes[path_in_repo] = local.stat().st_size
    if problems:
        raise ValueError("cannot push to the Hub:\n" + "\n".join(f"  - {p}" for p in problems))
    return sizes


def _transport_errors() -> tuple[type[BaseException], ...]:
    """Network failure types: huggingface_hub 2.x talks through httpx2, 1.x through httpx."""
    types: list[type[BaseException]] = [ConnectionError, TimeoutError]
    for module in ("httpx2", "httpx"):
        try:
            types.append(importlib.import_module(module).TransportError)
        except ImportError:
            continue
    return tuple(types)


def _classify(exc: BaseException) -> tuple[int | None, bool]:
    """(HTTP status or None, whether another attempt may succeed)."""
    from huggingface_hub.errors import HfHubHTTPError, OfflineModeIsEnabled

    transport = _transport_errors()
    for err in exception_chain(exc):  # huggingface_hub wraps LFS upload failures in a RuntimeError
        if isinstance(err, OfflineModeIsEnabled):
            return None, False
        if isinstance(err, HfHubHTTPError) and err.response is not None:
            status = err.response.status_code
            return status, status in _RETRIABLE_STATUS
        if isinstance(err, transport):
            return None, True
    return None, False


def _describe(exc: BaseException) -> str:
    """One line naming the failure: the wrappers' messages down to the first HTTP or network error."""
    from huggingface_hub.errors import HfHubHTTPError

    stop_at = (HfHubHTTPError, *_transport_errors())
    parts = []
    for err in exception_chain(exc):  # huggingface_hub wraps LFS upload failures in a RuntimeError
        if str(err):
            parts.append(f"{type(err).__name__}: {err}")
        if isinstance(err, stop_at):
            break
    text = " ".join(" <- ".join(parts).split()) or type(exc).__name__
    text = _MDN_LINK_RE.sub("", text)
    return text if len(text) <= 600 else text[:597] + "..."


def _redact(text: str, secrets: Iterable[str]) -> str:
    for secret in secrets:
        text = text.replace(secret, _REDACTED)
    text = _HF_TOKEN_RE.sub("hf_" + _REDACTED, text)
    return _BEARER_RE.sub(r"\g<1>" + _REDACTED, text)


def _advice(status: int | None, retriable: bool, detail: str, repo_id: str, branch: str, attempts: int) -> str:
    """A message that names the cause and the fix."""
    where = f"{repo_id}@{branch}"
    if status == 401:
        return (
            f"push to {where}: the Hub rejected the token (401). Set HF_TOKEN, or the Prefect Secret block "
            f"{_token_block_name()!r}, to a valid token with write access "
            f"(https://huggingface.co/settings/tokens). Details: {detail}"
        )
    if status == 403:
        return (
            f"push to {where}: the token may not write to {repo_id} (403). Use a token with write access "
            f"to the namespace {repo_id.split('/')[0]!r} (fine-grained tokens need 'write' on it). "
            f"Details: {detail}"
        )
    if status == 404:
        return (
            f"push to {where}: the Hub answered 404. Check that repo_id {repo_id!r} is right, its namespace "
            f"exists, and the token may see it. Details: {detail}"
        )
    if "OfflineModeIsEnabled" in detail:
        return (
            f"push to {where}: huggingface_hub is in offline mode (HF_HUB_OFFLINE or TRANSFORMERS_OFFLINE is "
            f"set when it was imported); unset both for the push step. Details: {detail}"
        )
    if retriable:
        return (
            f"push to {where} failed {attempts} time(s) with transient errors (Hub down or network "
            f"unreachable at {_endpoint()}); nothing half-written was committed, re-run later or raise "
            f"max_attempts. Last error: {detail}"
        )
    return f"push to {where} failed ({status or 'no HTTP status'}): {detail}"
