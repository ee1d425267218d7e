"""A local fake of the Hugging Face Hub's write API, so tests can run a real `huggingface_hub` push offline.

It implements what `HfApi.create_repo`, `create_branch` and `create_commit` call in huggingface_hub 2.4
when Xet is disabled (plain LFS): repo creation, repo info, README metadata validation, branch creation,
preupload (regular vs LFS), the LFS batch API with a "presigned" PUT and a verify call, and the ndjson
commit. It keeps every committed file so tests can compare bytes, records every request, remembers
paths it does not implement (tests assert there are none), and can inject faults: an HTTP status or a
dropped connection on the next N requests whose path matches a regex.
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import json
import re
import socket
import threading
from dataclasses import dataclass, field
from fnmatch import fnmatch
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, unquote, urlsplit

import yaml

# The Hub stores files of 10 MiB or more in LFS, and any file matching .gitattributes' LFS patterns.
LFS_THRESHOLD_BYTES = 10 * 1024 * 1024
_GITATTRIBUTES = "*.gguf filter=lfs diff=lfs merge=lfs -text\n*.safetensors filter=lfs diff=lfs merge=lfs -text\n"
_LFS_PATTERNS = tuple(line.split()[0] for line in _GITATTRIBUTES.splitlines())


@dataclass
class RecordedRequest:
    """One request as the server saw it (after fault injection decided its fate)."""

    method: str
    path: str
    query: str
    headers: dict[str, str]
    body: bytes
    status: int | None  # None when the connection was dropped on purpose


@dataclass
class Commit:
    oid: str
    summary: str
    description: str
    files: dict[str, bytes]  # the full tree after this commit


@dataclass
class Repo:
    repo_id: str
    private: bool
    branches: dict[str, list[Commit]] = field(default_factory=dict)

    def head(self, branch: str) -> Commit | None:
        history = self.branches.get(branch)
        return history[-1] if history else None


@dataclass
class _Fault:
    pattern: re.Pattern[str]
    status: int | None  # None drops the connection without an answer
    times: int
    after: bool  # handle the request first, then drop the answer (a commit whose response is lost)
    body: str | None
    method: str | None


class _HttpError(Exception):
    def __init__(self, status: int, message: str, error_code: str | None = None, **extra: object):
        super().__init__(message)
        self.status, self.message, self.error_code, self.extra = status, message, error_code, extra


class FakeHub:
    """A threaded fake Hub on 127.0.0.1; use as a context manager or call `start()` / `stop()`.

    Args:
        token: If set, API calls must carry `Authorization: Bearer <token>` (else 401, like the Hub).
        lfs_threshold: Files at least this large go to LFS (the Hub uses 10 MiB).
    """

    def __init__(self, token: str | None = None, lfs_threshold: int = LFS_THRESHOLD_BYTES):
        self.token = token
        self.lfs_threshold = lfs_threshold
        self.repos: dict[str, Repo] = {}
        self.lfs_objects: dict[str, bytes] = {}  # sha256 hex -> content, after a successful PUT
        self.verified: set[str] = set()
        self.requests: list[RecordedRequest] = []
        self.unknown: list[str] = []  # "METHOD /path" the fake does not implement
        self._faults: list[_Fault] = []
        self._lock = threading.RLock()
        self._httpd: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None

    # ---------------------------------------------------------------- lifecycle
    @property
    def endpoint(self) -> str:
        assert self._httpd is not None, "FakeHub is not started"
        host, port = self._httpd.server_address[:2]
        return f"http://{host}:{port}"

    def start(self) -> FakeHub:
        self._httpd = ThreadingHTTPServer(("127.0.0.1", 0), _make_handler(self))
        self._httpd.daemon_threads = True
        self._thread = threading.Thread(target=self._httpd.serve_forever, name="fake-hub", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        if self._httpd is not None:
            self._httpd.shutdown()
            self._httpd.server_close()
            self._httpd = None

    def __enter__(self) -> FakeHub:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # ---------------------------------------------------------------- test helpers
    def fail_next(
        self,
        path_regex: str,
        status: int | None,
        times: int = 1,
        *,
        body: str | None = None,
        method: str | None = None,
        after: bool = False,
    ) -> None:
        """Answer the next `times` requests whose path matches with `status` (None: drop the connection).

        `body` is sent as the error message; the placeholder `{authorization}` is replaced by the request's
        Authorization header, to imitate a server (or proxy) that echoes credentials back. With `after=True`
        (only for `status=None`) the request is carried out and only its answer is lost.
        """
        if after and status is not None:
            raise ValueError("after=True only makes sense with status=None (a lost answer)")
        with self._lock:
            self._faults.append(_Fault(re.compile(path_regex), status, times, after, body, method))

    def files(self, repo_id: str, revision: str = "main") -> dict[str, bytes]:
        head = self.repos[repo_id].head(revision)
        return dict(head.files) if head else {}

    def commits(self, repo_id: str, revision: str = "main") -> list[Commit]:
        return list(self.repos[repo_id].branches.get(revision, []))

    def requests_to(self, path_regex: str, method: str | None = None) -> list[RecordedRequest]:
        pattern = re.compile(path_regex)
        return [r for r in self.requests if pattern.search(r.path) and (method is None or r.method == method)]

    # ---------------------------------------------------------------- request handling
    def _take_fault(self, method: str, path: str) -> _Fault | None:
        with self._lock:
            for fault in self._faults:
                if fault.times > 0 and fault.pattern.search(path) and fault.method in (None, method):
                    fault.times -= 1
                    return fault
        return None

    def _check_auth(self, headers: dict[str, str]) -> None:
        if self.token is None:
            return
        if headers.get("authorization") != f"Bearer {self.token}":
            raise _HttpError(401, "Invalid credentials in Authorization header")

    def _repo(self, repo_id: str) -> Repo:
        repo = self.repos.get(repo_id)
        if repo is None:
            raise _HttpError(404, "Repository not found", "RepoNotFound")
        return repo

    def _branch_head(self, repo: Repo, revision: str) -> Commit:
        head = repo.head(revision)
        if head is None:
            raise _HttpError(404, f"Invalid rev id: {revision}", "RevisionNotFound")
        return head

    def dispatch(
        self, method: str, path: str, query: dict[str, list[str]], headers: dict[str, str], body: bytes
    ) -> tuple[int, dict | list | None]:
        """Route one request; returns (status, JSON body). Raises `_HttpError` for Hub-style errors."""
        m = re.fullmatch
        if method == "POST" and path == "/api/repos/create":
            self._check_auth(headers)
            return self._create_repo(json.loads(body))
        if method == "POST" and path == "/api/validate-yaml":
            return self._validate_yaml(json.loads(body))
        if method == "GET" and (g := m(r"/api/models/([^/]+/[^/]+)(?:/revision/([^/]+))?", path)):
            self._check_auth(headers)
            return self._repo_info(g[1], unquote(g[2] or "main"))
        if method == "POST" and (g := m(r"/api/models/([^/]+/[^/]+)/branch/([^/]+)", path)):
            self._check_auth(headers)
            return self._create_branch(g[1], unquote(g[2]), json.loads(body or b"{}"))
        if method == "POST" and (g := m(r"/api/models/([^/]+/[^/]+)/preupload/([^/]+)", path)):
            self._check_auth(headers)
            return self._preupload(g[1], unquote(g[2]), json.loads(body))
        if method == "POST" and (g := m(r"/([^/]+/[^/]+)\.git/info/lfs/objects/batch", path)):
            self._check_auth(headers)
            return self._lfs_batch(g[1], json.loads(body))
        if method == "PUT" and (g := m(r"/_fake_s3/([0-9a-f]{64})", path)):
            return self._lfs_put(g[1], query, body)  # presigned: no Authorization, like S3
        if method == "POST" and (g := m(r"/([^/]+/[^/]+)\.git/info/lfs/objects/verify", path)):
            self._check_auth(headers)
            return self._lfs_verify(json.loads(body))
        if method == "POST" and (g := m(r"/api/models/([^/]+/[^/]+)/commit/([^/]+)", path)):
            self._check_auth(headers)
            return self._commit(g[1], unquote(g[2]), body)
        with self._lock:
            self.unknown.append(f"{method} {path}")
        raise _HttpError(404, f"fake hub does not implement {method} {path}")

    def _create_repo(self, payload: dict) -> tuple[int, dict]:
        repo_id = f"{payload['organization']}/{payload['name']}" if payload.get("organization") else payload["name"]
        if "/" not in repo_id:
            raise _HttpError(400, "repo name must be namespace/name for this fake hub")
        url = f"{self.endpoint}/{repo_id}"
        with self._lock:
            if repo_id in self.repos:
                # The Hub's 409 still carries the url: create_repo(exist_ok=True) reads it.
                raise _HttpError(409, "You already created this model repo", url=url)
            repo = Repo(repo_id, private=payload.get("visibility") == "private")
            # The Hub makes an initial commit holding .gitattributes with the LFS patterns.
            initial = {".gitattributes": _GITATTRIBUTES.encode()}
            repo.branches["main"] = [Commit(_oid("initial", initial), "initial commit", "", initial)]
            self.repos[repo_id] = repo
        return 200, {"url": url, "name": repo_id, "id": repo_id}

    def _validate_yaml(self, payload: dict) -> tuple[int, dict]:
        content = payload["content"]
        if not content.startswith("---\n"):
            return 200, {
                "errors": [],
                "warnings": [{"message": "empty or missing yaml metadata in repo card"}],
            }
        front, sep, _ = content[4:].partition("\n---\n")
        try:
            data = yaml.safe_load(front) if sep else None
        except yaml.YAMLError as exc:
            return 400, {"errors": [{"message": f"YAML parse error: {exc}"}]}
        if not isinstance(data, dict):
            return 400, {"errors": [{"message": "metadata must be a YAML mapping"}]}
        return 200, {"errors": [], "warnings": []}

    def _repo_info(self, repo_id: str, revision: str) -> tuple[int, dict]:
        with self._lock:
            repo = self._repo(repo_id)
            head = self._branch_head(repo, revision)
            return 200, {
                "id": repo_id,
                "modelId": repo_id,
                "sha": head.oid,
                "private": repo.private,
                "siblings": [{"rfilename": name} for name in sorted(head.files)],
            }

    def _create_branch(self, repo_id: str, branch: str, payload: dict) -> tuple[int, dict]:
        with self._lock:
            repo = self._repo(repo_id)
            if branch in repo.branches:
                raise _HttpError(409, f"Reference already exists: refs/heads/{branch}")
            start = self._branch_head(repo, payload.get("startingPoint") or "main")
            repo.branches[branch] = [start]
        return 200, {}

    def _is_lfs(self, path: str, size: int, sample: bytes) -> bool:
        name = path.rsplit("/", 1)[-1]
        return size >= self.lfs_threshold or any(fnmatch(name, p) for p in _LFS_PATTERNS) or b"\x00" in sample

    def _preupload(self, repo_id: str, revision: str, payload: dict) -> tuple[int, dict]:
        with self._lock:
            head = self._branch_head(self._repo(repo_id), revision)
            answers = []
            for entry in payload["files"]:
                lfs = self._is_lfs(entry["path"], entry["size"], base64.b64decode(entry["sample"]))
                existing = head.files.get(entry["path"])
                oid = None
                if existing is not None:
                    oid = hashlib.sha256(existing).hexdigest() if lfs else _git_blob_sha1(existing)
                answers.append(
                    {
                        "path": entry["path"],
                        "uploadMode": "lfs" if lfs else "regular",
                        "shouldIgnore": False,
                        "oid": oid,
                    }
                )
        return 200, {"files": answers, "commitOid": head.oid}

    def _lfs_batch(self, repo_id: str, payload: dict) -> tuple[int, dict]:
        self._repo(repo_id)
        if payload.get("operation") != "upload":
            raise _HttpError(400, "fake hub only supports LFS uploads")
        objects = []
        for obj in payload["objects"]:
            oid, size = obj["oid"], obj["size"]
            answer = {"oid": oid, "size": size, "authenticated": True}
            with self._lock:
                stored = oid in self.lfs_objects
            if not stored:  # already stored: no actions, the client skips the upload
                answer["actions"] = {
                    "upload": {"href": f"{self.endpoint}/_fake_s3/{oid}?X-Amz-Signature=fake"},
                    "verify": {"href": f"{self.endpoint}/{repo_id}.git/info/lfs/objects/verify"},
                }
            objects.append(answer)
        return 200, {"transfer": "basic", "objects": objects}

    def _lfs_put(self, oid: str, query: dict[str, list[str]], body: bytes) -> tuple[int, None]:
        if "X-Amz-Signature" not in query:
            raise _HttpError(403, "missing presigned signature")
        if hashlib.sha256(body).hexdigest() != oid:
            raise _HttpError(400, "uploaded content does not match its sha256 oid")
        with self._lock:
            self.lfs_objects[oid] = body
        return 200, None

    def _lfs_verify(self, payload: dict) -> tuple[int, dict]:
        with self._lock:
            data = self.lfs_objects.get(payload["oid"])
            if data is None or len(data) != payload["size"]:
                raise _HttpError(404, f"LFS object {payload['oid']} was not uploaded")
            self.verified.add(payload["oid"])
        return 200, {}

    def _commit(self, repo_id: str, revision: str, body: bytes) -> tuple[int, dict]:
        lines = [json.loads(line) for line in body.decode().splitlines() if line.strip()]
        if not lines or lines[0].get("key") != "header":
            raise _HttpError(400, "commit payload must start with a header line")
        header = lines[0]["value"]
        with self._lock:
            repo = self._repo(repo_id)
            head = self._branch_head(repo, revision)
            if header.get("parentCommit") not in (None, head.oid):
                raise _HttpError(412, "A commit has happened since. Please refresh and try again.")
            tree = dict(head.files)
            for line in lines[1:]:
                value = line["value"]
                if line["key"] == "file" and value.get("encoding") == "base64":
                    tree[value["path"]] = base64.b64decode(value["content"])
                elif line["key"] == "lfsFile":
                    if value["oid"] not in self.verified:
                        raise _HttpError(422, f"LFS pointer for {value['path']} points to an object never uploaded")
                    tree[value["path"]] = self.lfs_objects[value["oid"]]
                elif line["key"] == "deletedFile":
                    tree.pop(value["path"], None)
                else:
                    raise _HttpError(400, f"fake hub does not support commit line {line['key']!r}")
            commit = Commit(
                _oid(head.oid + header["summary"], tree),
                header["summary"],
                header.get("description", ""),
                tree,
            )
            repo.branches[revision].append(commit)
        return 200, {
            "commitUrl": f"{self.endpoint}/{repo_id}/commit/{commit.oid}",
            "commitOid": commit.oid,
            "success": True,
            "pullRequestUrl": None,
        }


def _oid(seed: str, tree: dict[str, bytes]) -> str:
    digest = hashlib.sha1(seed.encode())
    for name in sorted(tree):
        digest.update(name.encode() + hashlib.sha256(tree[name]).digest())
    return digest.hexdigest()


def _git_blob_sha1(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def _make_handler(hub: FakeHub) -> type[BaseHTTPRequestHandler]:
    class _Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"  # keep-alive, as httpx expects from the Hub

        def log_message(self, format: str, *args: object) -> None:
            return

        def _read_body(self) -> bytes:
            if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
                chunks = []
                while True:
                    size = int(self.rfile.readline().split(b";")[0].strip(), 16)
                    if size == 0:
                        self.rfile.readline()
                        return b"".join(chunks)
                    chunks.append(self.rfile.read(size))
                    self.rfile.readline()
            return self.rfile.read(int(self.headers.get("Content-Length") or 0))

        def _handle(self) -> None:
            url = urlsplit(self.path)
            headers = {k.lower(): v for k, v in self.headers.items()}
            body = self._read_body()
            record = RecordedRequest(self.command, url.path, url.query, headers, body, None)
            with hub._lock:
                hub.requests.append(record)
            fault = hub._take_fault(self.command, url.path)
            if fault is not None and fault.status is None:
                if fault.after:
                    with contextlib.suppress(_HttpError):
                        hub.dispatch(self.command, url.path, parse_qs(url.query), headers, body)
                self.close_connection = True
                self.connection.shutdown(socket.SHUT_RDWR)
                return
            if fault is not None:
                message = (fault.body or "injected fault").replace("{authorization}", headers.get("authorization", ""))
                self._send(fault.status, {"error": message}, record)
                return
            try:
                status, payload = hub.dispatch(self.command, url.path, parse_qs(url.query), headers, body)
            except _HttpError as err:
                extra = {"X-Error-Code": err.error_code} if err.error_code else {}
                self._send(
                    err.status,
                    {"error": err.message, **err.extra},
                    record,
                    {"X-Error-Message": err.message, **extra},
                )
                return
            self._send(status, payload, record, {"ETag": '"fake-etag"'} if self.command == "PUT" else {})

        def _send(
            self,
            status: int,
            payload: object,
            record: RecordedRequest,
            extra_headers: dict[str, str] | None = None,
        ) -> None:
            record.status = status
            data = b"" if payload is None else json.dumps(payload).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            for key, value in (extra_headers or {}).items():
                self.send_header(key, value)
            self.end_headers()
            self.wfile.write(data)

        do_GET = do_POST = do_PUT = do_DELETE = _handle

    return _Handler
