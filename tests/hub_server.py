"""A loopback server that speaks enough of the Hugging Face Hub HTTP protocol for the real
``huggingface_hub`` client (``HfApi``, ``hf_hub_download``) to push to it and read back from it in tests.

Standard library only: a ``ThreadingHTTPServer`` on 127.0.0.1 (free port) in a background thread, with all
state in memory.

    with HubServer(tokens={"hf_alice": "alice", "hf_bob": "bob"}) as hub:
        hub.configure_client(monkeypatch, tmp_path / "hf_home")   # see "Client setup" below
        api = HfApi(endpoint=hub.url, token="hf_alice")
        api.create_repo("alice/model", private=True)
        api.upload_folder(repo_id="alice/model", folder_path=folder)
        assert len(hub.commits("alice/model")) == 2                # "initial commit" + the upload
        assert hub.files("alice/model")["config.json"] == b"..."

What it models (like the real Hub):
- repos keyed by (repo_type, "namespace/name"); a repo is born with one "initial commit" on ``main`` holding
  the Hub's default ``.gitattributes`` (pass ``gitattributes=False`` for an empty initial commit). So an
  upload to a new repo gives 2 commits, and ``verify_repo_checksums`` against a local folder reports
  ``.gitattributes`` in ``missing_paths``.
- branches and tags point to commits; commits hold a full snapshot ``path -> Blob``. Regular files carry the git
  blob sha1 of their content; LFS files carry the sha256 of their content and, as ``blob_id``, the git sha1 of
  their LFS pointer file (what the Hub reports).
- auth: ``Authorization: Bearer <token>``; an unknown token -> 401 (``X-Error-Message: Invalid credentials in
  Authorization header``, like the Hub, so the client raises a plain ``HfHubHTTPError`` and not
  ``RepositoryNotFoundError``). No token = anonymous (reads of public repos only).
  A user may write to their own namespace and to the orgs listed for them in ``orgs``. Private repos are 404
  (``RepoNotFound``) to everybody else; a write to a visible repo of another namespace is 403.
- errors carry ``X-Error-Code`` (``RepoNotFound``, ``RevisionNotFound``, ``EntryNotFound``), which is what the
  client uses to pick its exception class, plus ``X-Error-Message`` and a JSON ``{"error": ...}`` body.
- preupload answers ``uploadMode`` (lfs if >= 10 MiB, binary sample, or matched by ``filter=lfs`` in the
  revision's .gitattributes), ``shouldIgnore`` (.gitignore) and the remote ``oid`` of an existing file
  (sha256 for LFS, git sha1 otherwise). The client compares that oid with its local one and drops unchanged
  files, and makes no commit at all if nothing is left (it then calls ``repo_info`` to return the head sha).
- LFS batch answers no ``actions`` for objects the repo already has (so they are not re-uploaded); otherwise an
  upload href ``/_lfs/upload/<oid>?token=<grant>`` that carries its own token, because the client sends that PUT
  without an Authorization header, and a verify href.

Endpoints (``{t}`` = models|datasets|spaces|kernels, ``{p}`` = "" or "datasets/"|"spaces/"|"kernels/"):
    POST   /api/repos/create                 DELETE /api/repos/delete
    GET    /api/whoami-v2                    POST   /api/validate-yaml      GET /api/agent-harnesses
    GET    /api/{t}/{repo}                   GET    /api/{t}/{repo}/revision/{rev}      (?blobs=true)
    GET    /api/{t}/{repo}/tree/{rev}[/{path}]  (?recursive=true, paginated with Link: rel="next")
    POST   /api/{t}/{repo}/paths-info/{rev}  GET    /api/{t}/{repo}/refs
    GET    /api/{t}/{repo}/commits/{rev}     (paginated)
    POST   /api/{t}/{repo}/preupload/{rev}   POST   /api/{t}/{repo}/commit/{rev}        (NDJSON)
    POST   /api/{t}/{repo}/branch/{branch}   DELETE /api/{t}/{repo}/branch/{branch}
    POST   /api/{t}/{repo}/tag/{rev}         DELETE /api/{t}/{repo}/tag/{tag}
    POST   /{p}{repo}.git/info/lfs/objects/batch    POST /{p}{repo}.git/info/lfs/objects/verify
    PUT    /_lfs/upload/{oid}?token=...
    GET|HEAD /{p}{repo}/resolve/{rev}/{path}  (Range supported; served directly, no CDN redirect)
Not modelled: pull requests (``create_pr`` -> 400), Xet storage, multipart LFS, gated repos, spaces' runtime.

API:
    HubServer(tokens={token: user}, *, orgs={org: {users}}, gitattributes=True, page_size=1000)
    .start() / .close() or ``with``        .url                   -> "http://127.0.0.1:<port>"
    .configure_client(monkeypatch, hf_home)                       -> see "Client setup" below
    .commits(repo_id, branch="main", repo_type="model")          -> list[Commit], newest first (len = count)
    .files(repo_id, revision="main", repo_type="model")          -> dict[path, bytes] (revision: branch/tag/sha)
    .repo(repo_id, repo_type="model")                            -> live Repo (branches, tags, lfs_objects)
    .fail_next(method, path_regex, status, times=1, headers=None) -> next matching requests get `status`
    .drop_next(method, path_regex, times=1)                      -> next matching requests: connection closed
                                                                    without an answer (logged with status 0)
    .requests                                                    -> list[RequestRecord(method, path, status)]
    .server_errors                                               -> tracebacks of handler crashes (answered 501,
                                                                    which the client does not retry)

Client setup (why ``configure_client`` exists). ``huggingface_hub.constants`` reads the environment once, at
import time. Setting env vars in a test is therefore too late if anything imported ``huggingface_hub`` before
(transformers, another test module, a conftest). ``configure_client(monkeypatch, hf_home)`` sets the env vars
*and* patches the module constants the client reads at call time, undone by monkeypatch after the test:
- ``HF_HUB_DISABLE_XET`` -> True, unless ``xet=True``. With ``hf_xet`` installed the client sends every LFS-mode
  file to Xet storage (huggingface_hub 2.4 asks the server nothing before choosing; no local server can serve
  Xet), and ``upload_folder`` takes its pipelined multi-commit path. ``xet=True`` keeps the detection on for tests
  of that choice, with regular (small text) files only. Read at call time through ``constants.HF_HUB_DISABLE_XET``.
- ``HF_HUB_DISABLE_TELEMETRY`` -> True. Otherwise every request's user-agent builder calls ``detect_agent()``,
  which fetches ``{ENDPOINT}/api/agent-harnesses`` (the real Hub by default; 3 s timeout) and writes a cache
  file under ``HF_HOME``.
- ``HF_HOME`` and the paths derived from it at import time (``HF_HUB_CACHE``, ``HF_ASSETS_CACHE``,
  ``HF_TOKEN_PATH``, ``HF_STORED_TOKENS_PATH``, ``HF_XET_CACHE``, ``AGENT_HARNESSES_PATH``, ...) -> tmp dir, so
  downloads land in the test's cache and no saved user token is picked up.
- ``ENDPOINT`` / ``HUGGINGFACE_CO_URL_TEMPLATE`` -> this server, so code that builds ``HfApi()`` without an
  ``endpoint`` also talks to it (``HfApi(endpoint=hub.url)`` works without this).
- ``HF_HUB_OFFLINE`` -> False; ``HF_TOKEN``, ``HUGGING_FACE_HUB_TOKEN``, ``HF_OIDC_RESOURCE`` removed (read at
  call time; they would otherwise supply an implicit token).
Not patched: ``utils._http._HUB_ORIGINS`` (frozen at import; only matters for redirects, which this server does
not send) and the ``HF_HUB_CACHE`` copied by value into ``utils._cache_manager`` (``scan_cache_dir`` default).
"""

from __future__ import annotations

import base64
import fnmatch
import hashlib
import json
import os
import re
import secrets
import socket
import threading
import traceback
from dataclasses import dataclass, field
from datetime import datetime, timezone
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, Callable, NamedTuple
from urllib.parse import parse_qs, unquote, urlencode, urlsplit

DROPPED = 0  # status of an injected failure that closes the connection without answering
LFS_SIZE_THRESHOLD = 10 * 1024 * 1024  # the Hub stores anything this big in LFS
REPO_TYPES = {"models": "model", "datasets": "dataset", "spaces": "space", "kernels": "kernel"}
URL_PREFIXES = {"model": "", "dataset": "datasets/", "space": "spaces/", "kernel": "kernels/"}

# The Hub's default .gitattributes for new repos (shortened to the patterns that matter for ML checkpoints).
DEFAULT_GITATTRIBUTES = "".join(
    f"{pattern} filter=lfs diff=lfs merge=lfs -text\n"
    for pattern in (
        "*.7z", "*.arrow", "*.bin", "*.bz2", "*.ckpt", "*.ftz", "*.gz", "*.h5", "*.joblib", "*.lfs.*",
        "*.mlmodel", "*.model", "*.msgpack", "*.npy", "*.npz", "*.onnx", "*.ot", "*.parquet", "*.pb",
        "*.pickle", "*.pkl", "*.pt", "*.pth", "*.rar", "*.safetensors", "saved_model/**/*", "*.tar.*",
        "*.tar", "*.tflite", "*.tgz", "*.wasm", "*.xz", "*.zip", "*.zst", "*tfevents*",
    )
)


def git_blob_sha1(content: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(content) + content).hexdigest()


def _now_iso() -> str:
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%f")[:-3] + "Z"


# --------------------------------------------------------------------------------------------------- storage


@dataclass(frozen=True)
class Blob:
    content: bytes
    lfs: bool
    sha256: str
    blob_id: str  # git oid: of the content for regular files, of the LFS pointer file for LFS files
    pointer_size: int = 0

    @classmethod
    def regular(cls, content: bytes) -> "Blob":
        return cls(content, False, hashlib.sha256(content).hexdigest(), git_blob_sha1(content))

    @classmethod
    def large(cls, content: bytes, sha256: str) -> "Blob":
        pointer = f"version https://git-lfs.github.com/spec/v1\noid sha256:{sha256}\nsize {len(content)}\n"
        pointer_bytes = pointer.encode()
        return cls(content, True, sha256, git_blob_sha1(pointer_bytes), len(pointer_bytes))

    @property
    def size(self) -> int:
        return len(self.content)

    @property
    def remote_oid(self) -> str:
        # What preupload reports; the client compares it with sha256 (lfs) or git sha1 (regular) of its file.
        return self.sha256 if self.lfs else self.blob_id

    @property
    def etag(self) -> str:
        return self.sha256 if self.lfs else self.blob_id


@dataclass
class Commit:
    oid: str
    parent: str | None
    title: str
    message: str
    author: str
    date: str
    tree: dict[str, Blob]


@dataclass
class Repo:
    repo_type: str
    repo_id: str
    private: bool
    created_at: str
    commits: dict[str, Commit] = field(default_factory=dict)
    branches: dict[str, str] = field(default_factory=dict)  # name -> commit oid
    tags: dict[str, str] = field(default_factory=dict)
    lfs_objects: dict[str, bytes] = field(default_factory=dict)  # sha256 -> content, scoped to the repo

    @property
    def namespace(self) -> str:
        return self.repo_id.split("/")[0]

    def resolve(self, revision: str) -> Commit | None:
        """Branch, then tag, then full or abbreviated (>= 7 hex) commit oid, like git rev-parse."""
        oid = self.branches.get(revision) or self.tags.get(revision)
        if oid is None and re.fullmatch(r"[0-9a-f]{7,40}", revision):
            matches = [c for c in self.commits if c.startswith(revision)]
            oid = matches[0] if len(matches) == 1 else None
        return self.commits.get(oid) if oid else None

    def history(self, commit: Commit) -> list[Commit]:
        out = []
        current: Commit | None = commit
        while current is not None:
            out.append(current)
            current = self.commits.get(current.parent) if current.parent else None
        return out


class RequestRecord(NamedTuple):
    method: str
    path: str
    status: int


@dataclass
class _InjectedFailure:
    method: str
    path_regex: re.Pattern
    status: int
    remaining: int
    headers: dict[str, str]


# ------------------------------------------------------------------------------------------------- protocol


class HubError(Exception):
    def __init__(self, status: int, message: str, code: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.code, self.headers = status, message, code, headers or {}


def repo_not_found(repo_id: str) -> HubError:
    return HubError(404, f"Repository not found: {repo_id}", "RepoNotFound")


def revision_not_found(revision: str) -> HubError:
    return HubError(404, f"Invalid rev id: {revision}", "RevisionNotFound")


@dataclass
class Reply:
    status: int = 200
    body: bytes = b""
    headers: dict[str, str] = field(default_factory=dict)


def json_reply(obj: Any, status: int = 200, headers: dict | None = None) -> Reply:
    return Reply(status, json.dumps(obj).encode(), {"Content-Type": "application/json", **(headers or {})})


@dataclass
class Request:
    method: str
    path: str
    query: dict[str, list[str]]
    headers: Any  # email.message.Message from http.server
    body: bytes
    user: str | None
    args: dict[str, str] = field(default_factory=dict)  # unquoted route groups

    def json(self) -> Any:
        try:
            return json.loads(self.body or b"{}")
        except ValueError as err:
            raise HubError(400, f"Invalid JSON body: {err}") from err

    def flag(self, name: str) -> bool:
        return (self.query.get(name) or ["false"])[0].lower() in ("1", "true")


_API = r"/api/(?P<type>models|datasets|spaces|kernels)/(?P<repo_id>[^/]+/[^/]+)"
_URL_REPO = r"/(?:(?P<prefix>datasets|spaces|kernels)/)?(?P<repo_id>[^/]+/[^/]+)"

# (methods, path regex on the still-percent-encoded path, handler name). First match wins.
ROUTES: list[tuple[tuple[str, ...], str, str]] = [
    (("POST",), r"/api/repos/create", "create_repo"),
    (("DELETE",), r"/api/repos/delete", "delete_repo"),
    (("GET",), r"/api/whoami-v2", "whoami"),
    (("POST",), r"/api/validate-yaml", "validate_yaml"),
    (("GET",), r"/api/agent-harnesses", "agent_harnesses"),
    (("GET",), _API, "repo_info"),
    (("GET",), _API + r"/revision/(?P<rev>[^/]+)", "repo_info"),
    (("GET",), _API + r"/tree/(?P<rev>[^/]+)(?:/(?P<path>.+))?", "list_tree"),
    (("POST",), _API + r"/paths-info/(?P<rev>[^/]+)", "paths_info"),
    (("GET",), _API + r"/refs", "list_refs"),
    (("GET",), _API + r"/commits/(?P<rev>[^/]+)", "list_commits"),
    (("POST",), _API + r"/preupload/(?P<rev>[^/]+)", "preupload"),
    (("POST",), _API + r"/commit/(?P<rev>[^/]+)", "commit"),
    (("POST",), _API + r"/branch/(?P<name>[^/]+)", "create_branch"),
    (("DELETE",), _API + r"/branch/(?P<name>[^/]+)", "delete_branch"),
    (("POST",), _API + r"/tag/(?P<rev>[^/]+)", "create_tag"),
    (("DELETE",), _API + r"/tag/(?P<name>[^/]+)", "delete_tag"),
    (("POST",), _URL_REPO + r"\.git/info/lfs/objects/batch", "lfs_batch"),
    (("POST",), _URL_REPO + r"\.git/info/lfs/objects/verify", "lfs_verify"),
    (("PUT",), r"/_lfs/upload/(?P<oid>[0-9a-f]{64})", "lfs_upload"),
    (("GET", "HEAD"), _URL_REPO + r"/resolve/(?P<rev>[^/]+)/(?P<path>.+)", "resolve"),
]
_COMPILED_ROUTES = [(methods, re.compile(pattern + r"/?"), name) for methods, pattern, name in ROUTES]


def _read_body(handler: BaseHTTPRequestHandler) -> bytes:
    # Always drain the body, even for requests we reject: leftover bytes would corrupt the next request on the
    # keep-alive connection the client reuses.
    if "chunked" in handler.headers.get("Transfer-Encoding", "").lower():
        chunks = []
        while True:
            size = int(handler.rfile.readline().split(b";")[0].strip() or b"0", 16)
            if size == 0:
                while handler.rfile.readline() not in (b"\r\n", b"\n", b""):
                    pass  # trailers
                return b"".join(chunks)
            chunks.append(handler.rfile.read(size))
            handler.rfile.readline()
    length = int(handler.headers.get("Content-Length") or 0)
    return handler.rfile.read(length) if length else b""


def _pattern_matches(pattern: str, path: str) -> bool:
    # gitattributes/gitignore semantics, simplified: a pattern without "/" matches the basename anywhere.
    pattern = pattern.lstrip("/")
    if "/" not in pattern.rstrip("/"):
        return fnmatch.fnmatchcase(path.rsplit("/", 1)[-1], pattern) or any(
            fnmatch.fnmatchcase(part, pattern.rstrip("/")) for part in path.split("/")[:-1]
        )
    return fnmatch.fnmatchcase(path, pattern) or fnmatch.fnmatchcase(path, pattern.rstrip("/") + "/*")


def _lfs_patterns(gitattributes: str) -> list[str]:
    return [line.split()[0] for line in gitattributes.splitlines() if "filter=lfs" in line.split()[1:]]


def _ignore_patterns(gitignore: str) -> list[str]:
    return [line.strip() for line in gitignore.splitlines() if line.strip() and not line.startswith(("#", "!"))]


# --------------------------------------------------------------------------------------------------- server


class _HTTPServer(ThreadingHTTPServer):
    daemon_threads = True
    hub: "HubServer"


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive, as the client's connection pool expects
    server_version = "LoopbackHub/1.0"
    server: _HTTPServer

    def setup(self) -> None:
        super().setup()
        self.server.hub._track(self.connection, open_=True)

    def finish(self) -> None:
        self.server.hub._track(self.connection, open_=False)
        super().finish()

    def do_GET(self) -> None:
        self.server.hub._handle(self)

    do_HEAD = do_POST = do_PUT = do_DELETE = do_GET

    def log_message(self, format: str, *args: Any) -> None:
        pass  # hub.requests is the log


class HubServer:
    """In-memory Hugging Face Hub on a loopback port. Use as a context manager; see the module docstring."""

    def __init__(
        self,
        tokens: dict[str, str] | None = None,
        *,
        orgs: dict[str, set[str]] | None = None,
        gitattributes: bool = True,
        page_size: int = 1000,
    ):
        self.tokens = dict(tokens or {})  # token -> user name
        self.orgs = {org: set(members) for org, members in (orgs or {}).items()}
        self.gitattributes = gitattributes
        self.page_size = page_size
        self.server_errors: list[str] = []
        self._repos: dict[tuple[str, str], Repo] = {}
        self._upload_grants: dict[str, tuple[tuple[str, str], str, int]] = {}  # token -> (repo key, oid, size)
        self._failures: list[_InjectedFailure] = []
        self._log: list[RequestRecord] = []
        self._commit_counter = 0
        self._lock = threading.RLock()
        self._connections: set[socket.socket] = set()
        self._httpd: _HTTPServer | None = None
        self._thread: threading.Thread | None = None
        self.url = ""

    # ---- lifecycle

    def start(self) -> "HubServer":
        self._httpd = _HTTPServer(("127.0.0.1", 0), _Handler)
        self._httpd.hub = self
        self.url = f"http://127.0.0.1:{self._httpd.server_address[1]}"
        # Short poll interval: shutdown() waits up to one interval, paid at every test teardown.
        self._thread = threading.Thread(
            target=self._httpd.serve_forever, kwargs={"poll_interval": 0.05}, name="hub-server", daemon=True
        )
        self._thread.start()
        return self

    def close(self) -> None:
        if self._httpd is None:
            return
        self._httpd.shutdown()
        # The client's pool keeps idle keep-alive connections; close them so their handler threads end now.
        with self._lock:
            connections = list(self._connections)
        for conn in connections:
            try:
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        self._httpd.server_close()
        self._thread.join(timeout=5)
        self._httpd = None

    def __enter__(self) -> "HubServer":
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def _track(self, conn: socket.socket, open_: bool) -> None:
        with self._lock:
            (self._connections.add if open_ else self._connections.discard)(conn)

    # ---- test helpers

    def configure_client(self, monkeypatch: Any, hf_home: str | os.PathLike, *, xet: bool = False) -> None:
        """Point huggingface_hub at this server for one test (details in the module docstring).

        `xet=True` leaves the client's Xet detection on (`is_xet_available()` is True with `hf_xet` installed, as on
        a user's machine): `upload_folder` then takes its pipelined multi-commit path, and any LFS-mode file goes
        to Xet storage, which this server does not serve. Use it with regular (small, text) files only."""
        from huggingface_hub import constants

        home = str(hf_home)
        Path(home).mkdir(parents=True, exist_ok=True)
        for name, value in {
            "HF_ENDPOINT": self.url, "HF_HOME": home, "HF_HUB_DISABLE_XET": "0" if xet else "1",
            "HF_HUB_DISABLE_TELEMETRY": "1",
        }.items():
            monkeypatch.setenv(name, value)
        for name in ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "HF_OIDC_RESOURCE", "HF_HUB_OFFLINE",
                     "TRANSFORMERS_OFFLINE", "HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "HF_XET_CACHE",
                     "HF_TOKEN_PATH", "HUGGINGFACE_CO_STAGING"):
            monkeypatch.delenv(name, raising=False)
        patched = {
            "ENDPOINT": self.url,
            "HUGGINGFACE_CO_URL_TEMPLATE": self.url + "/{repo_id}/resolve/{revision}/{filename}",
            "HF_HUB_DISABLE_XET": not xet,
            "HF_HUB_DISABLE_TELEMETRY": True,
            "HF_HUB_OFFLINE": False,
            "HF_HOME": home,
            "HF_HUB_CACHE": os.path.join(home, "hub"),
            "HUGGINGFACE_HUB_CACHE": os.path.join(home, "hub"),
            "HF_ASSETS_CACHE": os.path.join(home, "assets"),
            "HUGGINGFACE_ASSETS_CACHE": os.path.join(home, "assets"),
            "HF_TOKEN_PATH": os.path.join(home, "token"),
            "HF_STORED_TOKENS_PATH": os.path.join(home, "stored_tokens"),
            "HF_XET_CACHE": os.path.join(home, "xet"),
            "AGENT_HARNESSES_PATH": os.path.join(home, ".agent_harnesses.json"),
            "CHECK_FOR_UPDATE_DONE_PATH": os.path.join(home, ".check_for_update_done"),
            "CHECK_FOR_SKILL_UPDATE_DONE_PATH": os.path.join(home, ".check_for_skill_update_done"),
        }
        for name, value in patched.items():
            if hasattr(constants, name):
                monkeypatch.setattr(constants, name, value)

    def commits(self, repo_id: str, branch: str = "main", repo_type: str = "model") -> list[Commit]:
        """Commits reachable from `branch`, newest first (same order as `HfApi.list_repo_commits`)."""
        with self._lock:
            repo = self._repos[(repo_type, repo_id)]
            return repo.history(repo.commits[repo.branches[branch]])

    def files(self, repo_id: str, revision: str = "main", repo_type: str = "model") -> dict[str, bytes]:
        with self._lock:
            commit = self._repos[(repo_type, repo_id)].resolve(revision)
            if commit is None:
                raise KeyError(f"{repo_id}@{revision}")
            return {path: blob.content for path, blob in commit.tree.items()}

    def repo(self, repo_id: str, repo_type: str = "model") -> Repo:
        """The live repo record (branches, tags, commits, lfs_objects) for assertions."""
        return self._repos[(repo_type, repo_id)]

    def fail_next(
        self, method: str, path_regex: str, status: int, times: int = 1, headers: dict[str, str] | None = None
    ) -> None:
        """Answer the next `times` requests matching (method or "*", re.search on the path) with `status`,
        before auth or routing, as a gateway would. E.g. `headers={"Retry-After": "0"}`."""
        with self._lock:
            self._failures.append(
                _InjectedFailure(method.upper(), re.compile(path_regex), status, times, dict(headers or {}))
            )

    def drop_next(self, method: str, path_regex: str, times: int = 1) -> None:
        """Close the connection of the next `times` matching requests without answering (body already read),
        as a dying proxy or network would: the client sees "Server disconnected without sending a response"."""
        self.fail_next(method, path_regex, DROPPED, times)

    @property
    def requests(self) -> list[RequestRecord]:
        with self._lock:
            return list(self._log)

    # ---- dispatch

    def _handle(self, handler: _Handler) -> None:
        split = urlsplit(handler.path)
        method, path = handler.command, split.path
        body = _read_body(handler)
        try:
            reply = self._injected_failure(method, path)
            if reply is None:
                request = Request(method, path, parse_qs(split.query), handler.headers, body, None)
                request.user = self._authenticate(handler.headers.get("Authorization"))
                reply = self._route(request)
        except HubError as err:
            reply = json_reply({"error": err.message}, err.status, err.headers)
            reply.headers["X-Error-Message"] = err.message
            if err.code:
                reply.headers["X-Error-Code"] = err.code
        except Exception:  # a bug in this server: answer 501, which the client does not retry, to fail fast
            self.server_errors.append(traceback.format_exc())
            reply = json_reply({"error": "loopback hub crashed:\n" + traceback.format_exc()}, 501)

        with self._lock:
            self._log.append(RequestRecord(method, path, reply.status))
        if reply.status == DROPPED:
            handler.close_connection = True
            return
        handler.send_response(reply.status)
        for name, value in reply.headers.items():
            handler.send_header(name, value)
        handler.send_header("Content-Length", str(len(reply.body)))  # for HEAD too: the size of the GET body
        handler.end_headers()
        if method != "HEAD":
            handler.wfile.write(reply.body)

    def _injected_failure(self, method: str, path: str) -> Reply | None:
        with self._lock:
            for failure in self._failures:
                if failure.remaining > 0 and failure.method in ("*", method) and failure.path_regex.search(path):
                    failure.remaining -= 1
                    return json_reply({"error": f"injected {failure.status}"}, failure.status, failure.headers)
        return None

    def _authenticate(self, authorization: str | None) -> str | None:
        if not authorization:
            return None
        scheme, _, token = authorization.partition(" ")
        user = self.tokens.get(token.strip()) if scheme.lower() == "bearer" else None
        if user is None:
            raise HubError(401, "Invalid credentials in Authorization header")
        return user

    def _route(self, request: Request) -> Reply:
        for methods, regex, name in _COMPILED_ROUTES:
            match = regex.fullmatch(request.path)
            if match and request.method in methods:
                request.args = {k: unquote(v) for k, v in match.groupdict().items() if v is not None}
                handler: Callable[[Request], Reply] = getattr(self, f"_h_{name}")
                with self._lock:  # handlers are quick; one lock keeps refs/commits consistent
                    return handler(request)
        # No X-Error-Code: the client raises a plain HfHubHTTPError, so a missing route is not mistaken for a
        # missing repo.
        raise HubError(404, f"Route not implemented by the loopback hub: {request.method} {request.path}")

    # ---- access control

    def _can_write(self, user: str | None, namespace: str) -> bool:
        return user is not None and (user == namespace or user in self.orgs.get(namespace, set()))

    def _repo_key(self, request: Request) -> tuple[str, str]:
        if "type" in request.args:
            return REPO_TYPES[request.args["type"]], request.args["repo_id"]
        return REPO_TYPES[request.args.get("prefix") or "models"], request.args["repo_id"]

    def _readable_repo(self, request: Request) -> Repo:
        key = self._repo_key(request)
        repo = self._repos.get(key)
        if repo is None or (repo.private and not self._can_write(request.user, repo.namespace)):
            raise repo_not_found(key[1])  # private repos are indistinguishable from missing ones
        return repo

    def _writable_repo(self, request: Request) -> Repo:
        repo = self._readable_repo(request)
        if request.user is None:
            raise HubError(401, "You must be authenticated to write to this repo")
        if not self._can_write(request.user, repo.namespace):
            raise HubError(403, f"You don't have the rights to write to {repo.repo_id}")
        return repo

    def _commit_at(self, repo: Repo, revision: str) -> Commit:
        commit = repo.resolve(revision)
        if commit is None:
            raise revision_not_found(revision)
        return commit

    def _branch_head(self, repo: Repo, branch: str) -> Commit:
        if branch not in repo.branches:
            raise revision_not_found(branch)  # commits go to branches only
        return repo.commits[repo.branches[branch]]

    # ---- repo lifecycle

    def _h_create_repo(self, request: Request) -> Reply:
        payload = request.json()
        if request.user is None:
            raise HubError(401, "You must be authenticated to create a repo")
        namespace = payload.get("organization") or request.user
        repo_type = payload.get("type") or "model"
        repo_id = f"{namespace}/{payload['name']}"
        url = f"{self.url}/{URL_PREFIXES[repo_type]}{repo_id}"
        if not self._can_write(request.user, namespace):
            raise HubError(403, f"You don't have the rights to create a repo under '{namespace}'")
        if (repo_type, repo_id) in self._repos:
            # The client reads "url" from the 409 body too when exist_ok=True.
            return json_reply({"error": f"You already created this {repo_type} repo", "url": url}, 409)
        now = _now_iso()
        repo = Repo(repo_type, repo_id, payload.get("visibility") == "private" or payload.get("private") is True,
                    created_at=now)
        initial_tree = {".gitattributes": Blob.regular(DEFAULT_GITATTRIBUTES.encode())} if self.gitattributes else {}
        self._add_commit(repo, "main", None, "initial commit", "", request.user, initial_tree)
        self._repos[(repo_type, repo_id)] = repo
        return json_reply({"url": url, "name": repo_id, "id": repo_id})

    def _h_delete_repo(self, request: Request) -> Reply:
        payload = request.json()
        repo_id = f"{payload.get('organization') or request.user}/{payload['name']}"
        key = (payload.get("type") or "model", repo_id)
        repo = self._repos.get(key)
        if repo is None or (repo.private and not self._can_write(request.user, repo.namespace)):
            raise repo_not_found(repo_id)
        if not self._can_write(request.user, repo.namespace):
            raise HubError(403, f"You don't have the rights to delete {repo_id}")
        del self._repos[key]
        return json_reply({})

    def _h_whoami(self, request: Request) -> Reply:
        if request.user is None:
            raise HubError(401, "Invalid credentials in Authorization header")
        orgs = [{"name": org, "type": "org"} for org, members in self.orgs.items() if request.user in members]
        return json_reply({
            "type": "user", "name": request.user, "fullname": request.user, "orgs": orgs,
            "auth": {"type": "access_token", "accessToken": {"displayName": "loopback", "role": "write"}},
        })

    def _h_validate_yaml(self, request: Request) -> Reply:
        return json_reply({"errors": [], "warnings": []})

    def _h_agent_harnesses(self, request: Request) -> Reply:
        return json_reply({"standardEnvVars": [], "harnesses": {}})

    # ---- reading

    def _h_repo_info(self, request: Request) -> Reply:
        repo = self._readable_repo(request)
        commit = self._commit_at(repo, request.args.get("rev", "main"))
        with_blobs = request.flag("blobs")
        siblings = []
        for path, blob in sorted(commit.tree.items()):
            sibling: dict[str, Any] = {"rfilename": path}
            if with_blobs:
                sibling.update(size=blob.size, blobId=blob.blob_id)
                if blob.lfs:
                    sibling["lfs"] = {"size": blob.size, "sha256": blob.sha256, "pointerSize": blob.pointer_size}
            siblings.append(sibling)
        info = {
            "_id": hashlib.sha1(repo.repo_id.encode()).hexdigest()[:24], "id": repo.repo_id,
            "author": repo.namespace, "sha": commit.oid, "lastModified": commit.date, "createdAt": repo.created_at,
            "private": repo.private, "disabled": False, "gated": False, "downloads": 0, "likes": 0, "tags": [],
            "siblings": siblings,
        }
        if repo.repo_type == "model":
            info["modelId"] = repo.repo_id
        if repo.repo_type == "space":
            info["sdk"] = "static"
        return json_reply(info)

    def _tree_entries(self, commit: Commit, base: str, recursive: bool) -> list[dict]:
        prefix = base.strip("/") + "/" if base.strip("/") else ""
        under = {p: b for p, b in commit.tree.items() if p.startswith(prefix)}
        if prefix and not under:
            raise HubError(404, f"{base} does not exist on this revision", "EntryNotFound")
        files, folders = [], set()
        for path, blob in under.items():
            rest = path[len(prefix):]
            parts = rest.split("/")
            for depth in range(1, len(parts) if recursive else min(2, len(parts))):
                folders.add(prefix + "/".join(parts[:depth]))
            if recursive or len(parts) == 1:
                files.append(self._file_entry(path, blob))
        dirs = [self._folder_entry(commit, path) for path in sorted(folders)]
        files.sort(key=lambda e: e["path"])
        # Non-recursive listings put folders first (like the Hub); recursive ones interleave by path.
        return dirs + files if not recursive else sorted(dirs + files, key=lambda e: e["path"])

    @staticmethod
    def _file_entry(path: str, blob: Blob) -> dict:
        entry: dict[str, Any] = {"type": "file", "oid": blob.blob_id, "size": blob.size, "path": path}
        if blob.lfs:
            entry["lfs"] = {"oid": blob.sha256, "size": blob.size, "pointerSize": blob.pointer_size}
        return entry

    @staticmethod
    def _folder_entry(commit: Commit, folder: str) -> dict:
        listing = "".join(f"{p}:{b.blob_id}\n" for p, b in sorted(commit.tree.items()) if p.startswith(folder + "/"))
        return {"type": "directory", "oid": hashlib.sha1(listing.encode()).hexdigest(), "size": 0, "path": folder}

    def _paginated(self, request: Request, items: list) -> Reply:
        # Same scheme for tree and commits: ?p=<page>, next page announced in a Link header (GitHub style).
        page = int((request.query.get("p") or ["0"])[0])
        start = page * self.page_size
        headers = {}
        if start + self.page_size < len(items):
            query = {k: v[0] for k, v in request.query.items()}
            query["p"] = str(page + 1)
            headers["Link"] = f'<{self.url}{request.path}?{urlencode(query)}>; rel="next"'
        return json_reply(items[start:start + self.page_size], headers=headers)

    def _h_list_tree(self, request: Request) -> Reply:
        repo = self._readable_repo(request)
        commit = self._commit_at(repo, request.args["rev"])
        return self._paginated(request, self._tree_entries(commit, request.args.get("path", ""), request.flag("recursive")))

    def _h_paths_info(self, request: Request) -> Reply:
        repo = self._readable_repo(request)
        commit = self._commit_at(repo, request.args["rev"])
        form = parse_qs(request.body.decode()) if request.body else {}
        if request.headers.get("Content-Type", "").startswith("application/json"):
            form = {"paths": request.json().get("paths", [])}
        out = []
        for path in form.get("paths", []):
            path = path.strip("/")
            if path in commit.tree:
                out.append(self._file_entry(path, commit.tree[path]))
            elif any(p.startswith(path + "/") for p in commit.tree):
                out.append(self._folder_entry(commit, path))
        return json_reply(out)

    def _h_list_refs(self, request: Request) -> Reply:
        repo = self._readable_repo(request)

        def refs(kind: str, names: dict[str, str]) -> list[dict]:
            return [{"name": n, "ref": f"refs/{kind}/{n}", "targetCommit": oid} for n, oid in names.items()]

        body = {"branches": refs("heads", repo.branches), "tags": refs("tags", repo.tags), "converts": []}
        if request.flag("include_prs"):
            body["pullRequests"] = []
        return json_reply(body)

    def _h_list_commits(self, request: Request) -> Reply:
        repo = self._readable_repo(request)
        history = repo.history(self._commit_at(repo, request.args["rev"]))
        items = [
            {"id": c.oid, "title": c.title, "message": c.message, "date": c.date,
             "authors": [{"user": c.author, "avatar": None}]}
            for c in history
        ]
        return self._paginated(request, items)

    def _h_resolve(self, request: Request) -> Reply:
        repo = self._readable_repo(request)
        commit = self._commit_at(repo, request.args["rev"])
        blob = commit.tree.get(request.args["path"])
        if blob is None:
            # The client caches "file does not exist at this commit" using X-Repo-Commit.
            raise HubError(404, "Entry not found", "EntryNotFound", {"X-Repo-Commit": commit.oid})
        headers = {
            "X-Repo-Commit": commit.oid, "ETag": f'"{blob.etag}"', "Accept-Ranges": "bytes",
            "Content-Type": "application/octet-stream",
        }
        if blob.lfs:
            headers.update({"X-Linked-Etag": f'"{blob.sha256}"', "X-Linked-Size": str(blob.size)})
        content, status = blob.content, 200
        match = re.fullmatch(r"bytes=(\d*)-(\d*)", request.headers.get("Range", ""))
        if match and (match.group(1) or match.group(2)):
            first, last = match.groups()
            start = int(first) if first else max(0, blob.size - int(last))
            end = min(int(last), blob.size - 1) if first and last else blob.size - 1
            if start >= blob.size:
                raise HubError(416, "Range not satisfiable", headers={"Content-Range": f"bytes */{blob.size}"})
            content, status = blob.content[start:end + 1], 206
            headers["Content-Range"] = f"bytes {start}-{end}/{blob.size}"
        return Reply(status, content, headers)

    # ---- writing

    def _h_preupload(self, request: Request) -> Reply:
        repo = self._writable_repo(request)
        self._reject_pull_requests(request)
        head = self._branch_head(repo, request.args["rev"])
        payload = request.json()
        gitattributes = head.tree.get(".gitattributes")
        lfs_patterns = _lfs_patterns(gitattributes.content.decode(errors="replace")) if gitattributes else []
        gitignore = payload.get("gitIgnore")
        if gitignore is None and ".gitignore" in head.tree:
            gitignore = head.tree[".gitignore"].content.decode(errors="replace")
        ignore_patterns = _ignore_patterns(gitignore or "")
        answers = []
        for item in payload.get("files", []):
            path, size = item["path"], int(item["size"])
            sample = base64.b64decode(item.get("sample", ""))
            is_lfs = (
                size >= LFS_SIZE_THRESHOLD
                or b"\0" in sample  # git's binary heuristic
                or any(_pattern_matches(p, path) for p in lfs_patterns)
            )
            answer = {
                "path": path,
                "uploadMode": "lfs" if is_lfs else "regular",
                "shouldIgnore": any(_pattern_matches(p, path) for p in ignore_patterns),
            }
            if path in head.tree:
                answer["oid"] = head.tree[path].remote_oid
            answers.append(answer)
        return json_reply({"files": answers, "commitOid": head.oid})

    def _h_commit(self, request: Request) -> Reply:
        repo = self._writable_repo(request)
        self._reject_pull_requests(request)
        branch = request.args["rev"]
        head = self._branch_head(repo, branch)
        lines = [json.loads(line) for line in request.body.splitlines() if line.strip()]
        if not lines or lines[0].get("key") != "header":
            raise HubError(400, "The first NDJSON line must be the commit header")
        header = lines[0]["value"]
        parent = header.get("parentCommit")
        if parent and parent != head.oid:
            raise HubError(412, f"A commit has happened since {parent}. Please refresh and try again.")
        tree = dict(head.tree)
        for line in lines[1:]:
            self._apply_operation(repo, tree, line.get("key"), line.get("value") or {})
        commit = self._add_commit(repo, branch, head.oid, header.get("summary") or "", header.get("description") or "",
                                  request.user, tree)
        return json_reply({
            "success": True, "commitOid": commit.oid, "hookOutput": "", "pullRequestUrl": None,
            "commitUrl": f"{self.url}/{URL_PREFIXES[repo.repo_type]}{repo.repo_id}/commit/{commit.oid}",
        })

    def _apply_operation(self, repo: Repo, tree: dict[str, Blob], key: str | None, value: dict) -> None:
        path = str(value.get("path", "")).strip("/")
        if key == "file":
            raw = value.get("content", "")
            content = base64.b64decode(raw) if value.get("encoding") == "base64" else raw.encode()
            tree[path] = Blob.regular(content)
        elif key == "lfsFile":
            oid = value.get("oid", "")
            content = repo.lfs_objects.get(oid)
            if content is None:
                raise HubError(400, f"LFS object {oid} for '{path}' was never uploaded to this repo")
            if "size" in value and int(value["size"]) != len(content):
                raise HubError(400, f"LFS object {oid}: size {value['size']} != stored {len(content)}")
            tree[path] = Blob.large(content, oid)
        elif key == "deletedFile":
            if path not in tree:
                raise HubError(404, f"A file with this name doesn't exist: {path}", "EntryNotFound")
            del tree[path]
        elif key == "deletedFolder":
            doomed = [p for p in tree if p.startswith(path + "/")] if path else list(tree)
            if not doomed:
                raise HubError(404, f"A folder with this name doesn't exist: {path}", "EntryNotFound")
            for p in doomed:
                del tree[p]
        else:
            raise HubError(400, f"Unsupported commit operation: {key}")

    def _add_commit(self, repo: Repo, branch: str, parent: str | None, title: str, message: str, author: str,
                    tree: dict[str, Blob]) -> Commit:
        self._commit_counter += 1
        digest_input = f"{parent}\n{title}\n{author}\n{self._commit_counter}\n" + "".join(
            f"{p}:{b.blob_id}\n" for p, b in sorted(tree.items())
        )
        commit = Commit(hashlib.sha1(digest_input.encode()).hexdigest(), parent, title, message, author,
                        _now_iso(), tree)
        repo.commits[commit.oid] = commit
        repo.branches[branch] = commit.oid
        return commit

    @staticmethod
    def _reject_pull_requests(request: Request) -> None:
        if request.flag("create_pr"):
            raise HubError(400, "create_pr is not supported by the loopback hub")

    def _h_create_branch(self, request: Request) -> Reply:
        repo = self._writable_repo(request)
        name = request.args["name"]
        if name in repo.branches:
            raise HubError(409, f"Reference already exists: refs/heads/{name}")
        start = self._commit_at(repo, request.json().get("startingPoint") or "main")
        repo.branches[name] = start.oid
        return json_reply({})

    def _h_delete_branch(self, request: Request) -> Reply:
        repo = self._writable_repo(request)
        name = request.args["name"]
        if name == "main":
            raise HubError(403, "Cannot delete the default branch")
        if repo.branches.pop(name, None) is None:
            raise revision_not_found(name)
        return json_reply({})

    def _h_create_tag(self, request: Request) -> Reply:
        repo = self._writable_repo(request)
        target = self._commit_at(repo, request.args["rev"])
        name = request.json().get("tag")
        if not name:
            raise HubError(400, "Missing 'tag' in body")
        if name in repo.tags:
            raise HubError(409, f"Reference already exists: refs/tags/{name}")
        repo.tags[name] = target.oid
        return json_reply({})

    def _h_delete_tag(self, request: Request) -> Reply:
        repo = self._writable_repo(request)
        if repo.tags.pop(request.args["name"], None) is None:
            raise revision_not_found(request.args["name"])
        return json_reply({})

    # ---- LFS (git-lfs batch API, "basic" transfer)

    def _h_lfs_batch(self, request: Request) -> Reply:
        repo = self._writable_repo(request)
        payload = request.json()
        if payload.get("operation") != "upload":
            raise HubError(400, "The loopback hub only implements LFS uploads")
        base = f"{self.url}/{URL_PREFIXES[repo.repo_type]}{repo.repo_id}.git/info/lfs/objects"
        objects = []
        for obj in payload.get("objects", []):
            oid, size = obj.get("oid"), obj.get("size")
            if not (isinstance(oid, str) and re.fullmatch(r"[0-9a-f]{64}", oid) and isinstance(size, int)):
                objects.append({"oid": str(oid), "size": int(size or 0),
                                "error": {"code": 422, "message": "Invalid oid or size"}})
            elif oid in repo.lfs_objects:
                objects.append({"oid": oid, "size": size})  # no "actions": the client skips the upload
            else:
                grant = secrets.token_urlsafe(16)
                self._upload_grants[grant] = ((repo.repo_type, repo.repo_id), oid, size)
                objects.append({"oid": oid, "size": size, "authenticated": True, "actions": {
                    "upload": {"href": f"{self.url}/_lfs/upload/{oid}?token={grant}"},
                    "verify": {"href": f"{base}/verify"},
                }})
        return Reply(200, json.dumps({"transfer": "basic", "objects": objects}).encode(),
                     {"Content-Type": "application/vnd.git-lfs+json"})

    def _h_lfs_upload(self, request: Request) -> Reply:
        grant = self._upload_grants.get((request.query.get("token") or [""])[0])
        if grant is None or grant[1] != request.args["oid"]:
            raise HubError(403, "Invalid or missing upload token")
        repo_key, oid, size = grant
        repo = self._repos.get(repo_key)
        if repo is None:
            raise repo_not_found(repo_key[1])
        if len(request.body) != size or hashlib.sha256(request.body).hexdigest() != oid:
            raise HubError(400, f"Uploaded content does not match oid {oid} / size {size}")
        repo.lfs_objects[oid] = request.body
        return Reply(200)

    def _h_lfs_verify(self, request: Request) -> Reply:
        repo = self._writable_repo(request)
        payload = request.json()
        content = repo.lfs_objects.get(payload.get("oid"))
        if content is None or len(content) != payload.get("size"):
            raise HubError(404, f"LFS object {payload.get('oid')} not found")
        return json_reply({"success": True})
