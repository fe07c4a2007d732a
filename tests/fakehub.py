"""A stand-in for the Hub's bucket API that the real `huggingface_hub` client can talk to offline.

Routes and wire formats follow huggingface_hub 2.4's bucket client (`huggingface_hub.hf_api`, `_buckets`).
File bytes go through Xet's CAS API, served under `/cas` as the Hub's CAS service serves it to `hf_xet`
(xet-core's `RemoteClient`): its Xet token routes answer `casUrl: <endpoint>/cas`, the client uploads xorbs
(`POST /v1/xorbs/default/{hash}`, kept in a folder) and shards (`POST /v1/shards`: the fake reads each file's
terms out of the shard's file info section, and refuses with a 400 a shard naming a xorb it lacks), and
reads a file by its reconstruction (`GET /v1/reconstructions/{hash}`: xorb chunk ranges, and the byte ranges
to fetch them from `/v1/fetch_term`). The v2 routes and global dedup answer 404: the client falls back to v1
and skips dedup. So any number of processes, each with its own huggingface_hub client and Xet session (and
Xet cache, `client_cache`), read and write the same buckets. CAS requests carry a Xet token, not the user's:
the token routes hand out one per request, valid for `xet_token_s` on the test clock (an expired one is
answered 401), and the CAS calls made with it (reconstructions, xorbs, shards; not the presigned fetches)
count in the class `cas` of the user it was issued to, against no quota; they are not in `requests`.

Space repos (for the deploy command): create, README metadata validation, commits of regular (base64) files,
the file tree, variables, secrets and hardware requests. Files are kept in memory.

The Hub's terms, as huggingface_hub 2.4 meets them:
- quotas: per user (each token a user of its own, unless `user_of` maps it to one: then its requests are
  counted apart and spend that user's quota), per fixed window (`window_s`, 300 s) and per class (`api`: every
  `/api/` route; `resolvers`: `/buckets/.../resolve/`), `quotas` defaulting to the free tier (1,000 / 5,000).
  Every answer carries the `RateLimit` / `RateLimit-Policy` headers (what the user has left); over quota the
  answer is a 429 with `r=0` and the seconds to the window's end (the client's `parse_ratelimit_headers`).
  `counts` holds every window's requests per token and class (and `limited` its 429s), so tests and
  benchmarks can hold budgets;
- tree listings come in pages of `page_size` entries linked by the `Link: <...>; rel="next"` header;
- the bucket change feed `GET /api/buckets/{id}/events` (`feed = False`: 404, not served), in the wire format
  of huggingface_hub's `_bucket_live_follow`: replayed `changes` (from `?cursor=` or `?since=`), then `ready`
  with the cursor, then one `changes` event per batch as it lands, `: keep-alive` comments every
  `keepalive_s` (real seconds), a `reset` for a cursor older than the last `feed_buffer` changes, and a
  `reconnect` with the cursor once a session has lasted `feed_session_s`;
- faults: `stale_s` (reads of a path overwritten less than that long ago see its previous entry: listings,
  paths-info and resolve; every `stale_every`th such read; not for `fresh_tokens`), `lose_responses(n,
  status)` (the next n batches land, but are answered `status`), `fail_status` (every request fails),
  `feed_status` (the feed's open sessions end and new ones are answered that status: a feed outage), `stall`
  (requests are taken but not answered while it is set: a stalled Hub or a half-open connection).
A test clock (`clock`, default `time.time`) or short windows keep tests fast; the client itself sleeps in real
time until a 429's window ends.

Not modelled: copies, listing/moving/settings of buckets, visibility; LFS/Xet files in repos (preupload
answers "regular" for every file), dataset repos, Space runtimes and builds. Model repos: tests/fakemodels.py.
"""

import asyncio
import base64
import collections
import contextlib
import hashlib
import itertools
import json
import math
import secrets
import struct
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from urllib.parse import urlencode

import yaml
from fastapi import APIRouter, FastAPI, HTTPException, Request, Response
from fastapi.responses import JSONResponse, StreamingResponse
from huggingface_hub.utils import parse_datetime
from starlette.datastructures import MutableHeaders

from tests.fakemodels import ModelRepos, model_routes
from trainer.processes import serving_in_thread

USER = "user"  # whom the token belongs to: the `me` namespace
XET_TOKEN = "xet"  # the fake's own CAS access token (its resolver reads the CAS with it): never expires
FREE_TIER = {"api": 1000, "resolvers": 5000}  # requests per 5-minute window (hub-docs: rate limits)
PRO_TIER = {"api": 2500, "resolvers": 12000}


def _iso(t: float) -> str:
    # The client's parse_datetime wants exactly this shape (it rejects "+00:00").
    dt = datetime.fromtimestamp(t, UTC)
    return dt.strftime("%Y-%m-%dT%H:%M:%S.") + f"{dt.microsecond // 1000:03d}Z"


def request_class(path: str) -> str | None:
    """The quota a request counts against: `api`, `resolvers`, `cas` (no quota), or None (not counted)."""
    if path.startswith("/cas/"):
        # A fetch is a presigned storage URL; a v2 route answers 404 here and the client asks v1 instead,
        # where the Hub's CAS would answer the v2 call alone: one call either way.
        return "cas" if path.startswith("/cas/v1/") and not path.startswith("/cas/v1/fetch_term") else None
    if path.startswith("/api/"):
        return "api"
    if "/resolve/" in path:
        return "resolvers"
    return None


@dataclass
class Window:
    """The requests of one fixed window, per class, and how many of them were refused (429)."""

    start: float
    counts: collections.Counter[str] = field(default_factory=collections.Counter)
    limited: collections.Counter[str] = field(default_factory=collections.Counter)


@dataclass
class Change:
    """One entry of a bucket's change feed."""

    seq: int
    at: float
    bucket: str
    batch: int  # the seq of its batch's first change: one feed event per batch
    change: dict
    wall: float = field(default_factory=time.time)  # when it landed, on the real clock


@dataclass
class Space:
    """A Space repo on the fake Hub."""

    sdk: str
    private: bool
    hardware: str | None = None
    files: dict[str, bytes] = field(default_factory=dict)
    variables: dict[str, str] = field(default_factory=dict)
    secrets: dict[str, str] = field(default_factory=dict)
    commits: int = 0


class FakeHub:
    """The Hub at `endpoint`, accepting `token` only. Start with `start()`; tests may set `fail_status`."""

    def __init__(self, cas_dir: Path, token: str = "hf_fake_token"):
        self.token = token
        self.tokens = {token}  # accepted: each has its own windows (one per component, to count them apart)
        # token -> the user it belongs to, whose quota it spends (default: a user of its own)
        self.user_of: dict[str, str] = {}
        self.endpoint = ""
        self._serving = contextlib.ExitStack()
        self._lock = threading.Lock()  # the server's threads and the test's share the state below
        self._xorbs = cas_dir / "xorbs"
        self._xorbs.mkdir(parents=True, exist_ok=True)
        # The Xet client keeps a dedup cache per endpoint URL (HF_XET_CACHE): this Hub's clients need one of
        # their own, or a fake on a port an earlier fake used would be sent shards naming that one's xorbs.
        self.client_cache = cas_dir / "client-xet-cache"
        self._files: dict[str, list[Term]] = {}  # xet file hash -> its terms, from the uploaded shards
        self._xorb_data: dict[str, bytes] = {}  # xorb -> its bytes, as read from the folder (`_xorb`)
        self._term_bytes: dict[tuple[str, int, int], tuple[int, int]] = {}  # (xorb, chunks) -> byte range
        self.closing = False
        self._sessions: set[tuple[asyncio.AbstractEventLoop, asyncio.Event]] = set()  # open feed sessions
        self.reset()
        self.app = self._build_app()

    def reset(self) -> None:
        """An empty Hub on the default terms (free tier, 5-minute windows, feed served, no faults)."""
        self.buckets: dict[str, dict[str, dict]] = {}  # bucket id -> path -> file entry (wire format)
        self.previous: dict[tuple[str, str], tuple[float, dict]] = {}  # overwritten at, entry before
        self.spaces: dict[str, Space] = {}  # Space id -> what was created, committed and configured
        self.models = ModelRepos()  # model repositories (tests/fakemodels.py)
        self.requests: list[str] = []  # "METHOD /path" of every request, so tests can count round trips
        self.fail_status: int | None = None  # when set, every request fails with it (an outage)
        self.stall = False  # while set, requests (not the CAS's) get no answer
        self.feed_status: int | None = None  # when set, the feed alone fails with it
        self.clock: Callable[[], float] = time.time
        self.quotas: dict[str, int] = dict(FREE_TIER)
        self.window_s = 300.0
        self.windows: dict[tuple[str, int], Window] = {}  # (token, window index) -> its requests
        self._user_windows: dict[tuple[str, int], collections.Counter[str]] = {}  # what each user's spent
        self.page_size = 1000
        self.feed = True
        self.feed_buffer = 10_000
        self.feed_session_s = 600.0
        self.keepalive_s = 15.0
        self.feed_check_s = 0.25  # real seconds between an idle session's checks for faults and its end
        self.changes: list[Change] = []  # a new list per reset: the feed's sessions from before end
        self._events: dict[tuple[int, int], bytes] = {}  # (first, last seq) -> that feed event, encoded
        self.stale_s = 0.0
        self.stale_every = 1  # 2: every other read in the window is stale (two caches, one caught up)
        self._stale_reads = 0
        self.fresh_tokens: set[str] = set()
        self.xet_token_s = 3600.0
        self.xet_tokens: dict[str, tuple[str, float]] = {XET_TOKEN: ("", math.inf)}  # -> user's, valid until
        self._lost: tuple[int, int] = (0, 500)
        self.updated_at: dict[str, float] = {}
        self._wake_feed()  # sessions from before end

    def lose_responses(self, n: int, status: int = 500) -> None:
        """The next `n` batch requests land, but are answered `status` (the client sees an error)."""
        self._lost = (n, status)

    def counts(self, cls: str, token: str | None = None) -> list[int]:
        """Requests of class `cls` in each window so far (of `token`, default all), oldest first."""
        per_window: collections.Counter[int] = collections.Counter()
        for (bearer, index), window in self.windows.items():
            if token is None or bearer == f"Bearer {token}":
                per_window[index] += window.counts[cls]
        return [per_window[i] for i in sorted(per_window)]

    def limited(self) -> int:
        """429 answers so far."""
        return sum(sum(w.limited.values()) for w in self.windows.values())

    def total(self, cls: str) -> int:
        return sum(w.counts[cls] for w in self.windows.values())

    def _count(self, token: str, cls: str) -> tuple[int, float, Window]:
        """Count a request of `token` ("Bearer ..."); returns (requests its user has left in the window,
        seconds to the window's end, the token's window)."""
        now = self.clock()
        index = math.floor(now / self.window_s)
        window = self.windows.setdefault((token, index), Window(index * self.window_s))
        window.counts[cls] += 1
        user = self.user_of.get(token.removeprefix("Bearer "), token)
        spent = self._user_windows.setdefault((user, index), collections.Counter())
        spent[cls] += 1
        left = self.quotas.get(cls, 2**62) - spent[cls]  # `cas`: no quota
        return int(max(left, 0)) if left >= 0 else -1, (index + 1) * self.window_s - now, window

    @property
    def cas_url(self) -> str:
        return f"{self.endpoint}/cas"

    def start(self) -> None:
        self.endpoint = self._serving.enter_context(serving_in_thread(self.app))

    def stop(self) -> None:
        self.closing = True  # ends the feed's open streams, which would hold the server's shutdown
        self._wake_feed()
        self._serving.close()

    def size(self, xet_hash: str) -> int:
        return sum(term.unpacked_length for term in self._files.get(xet_hash, []))

    def _xorb(self, name: str) -> bytes:
        """A xorb's bytes, kept once read: a xorb is named by its content, so it never changes (a fleet's
        reads of one delta would each read the file again)."""
        data = self._xorb_data.get(name)
        if data is None:
            data = self._xorb_data[name] = (self._xorbs / name).read_bytes()
        return data

    def _chunk_bytes(self, term: "Term") -> tuple[int, int]:
        key = (term.xorb, term.start, term.end)
        if key not in self._term_bytes:
            self._term_bytes[key] = _chunk_bytes(self._xorb(term.xorb), term.start, term.end)
        return self._term_bytes[key]

    def entry(self, bucket: str, path: str, request: Request) -> dict | None:
        """What a read of `path` sees now: its previous entry while an overwrite is within `stale_s` (except
        for the tokens in `fresh_tokens`: a writer that reads its own writes)."""
        entry = self.buckets[bucket].get(path)
        before = self.previous.get((bucket, path))
        fresh = (request.headers.get("authorization") or "").removeprefix("Bearer ") in self.fresh_tokens
        if entry is not None and before is not None and self.clock() < before[0] + self.stale_s and not fresh:
            self._stale_reads += 1
            if self._stale_reads % self.stale_every == 0:  # behind a cache that has not caught up
                return before[1]
        return entry

    def _record(self, bucket: str, changes: list[dict]) -> None:
        now, batch = self.clock(), len(self.changes) + 1
        self.updated_at[bucket] = now
        for change in changes:
            self.changes.append(Change(len(self.changes) + 1, now, bucket, batch, change))
        self._wake_feed()

    def _wake_feed(self) -> None:
        """Every open feed session sends what is new at once (they wait for this, not poll): one wake-up of
        each event loop, not one per session."""
        loops: dict[asyncio.AbstractEventLoop, list[asyncio.Event]] = collections.defaultdict(list)
        for loop, news in list(self._sessions):
            loops[loop].append(news)
        for loop, events in loops.items():
            loop.call_soon_threadsafe(lambda events=events: [news.set() for news in events])

    def _changes_event(self, group: list[Change]) -> bytes:
        """A feed event of changes of one batch, encoded once for every session that sends it."""
        key = (group[0].seq, group[-1].seq)
        event = self._events.get(key)
        if event is None:
            payload = {"cursor": str(group[-1].seq), "changes": [c.change for c in group]}
            event = self._events[key] = _event("changes", payload)
        return event

    def read(self, xet_hash: str) -> bytes:
        """A file's bytes, read out of the CAS by this process's Xet session (a real client decodes them)."""
        import hf_xet
        from huggingface_hub.utils._xet import get_xet_session

        if not self._files.get(xet_hash):
            return b""  # an empty file has no terms
        with tempfile.TemporaryDirectory() as tmp:
            dest = Path(tmp) / "file"
            expiry = int(time.time()) + 3600
            session = get_xet_session().new_file_download_group(
                endpoint=self.cas_url, token=XET_TOKEN, token_expiry_unix_secs=expiry
            )
            with session as group:
                group.start_download_file(hf_xet.XetFileInfo(xet_hash), str(dest))
            return dest.read_bytes()

    def admit(self, request: Request) -> tuple[Response | None, dict[str, str]]:
        """The Hub's terms for `request` (after any stall): the answer that refuses it (None: served), and
        the headers its answer carries (the quota it spent)."""
        path = request.url.path
        if path.startswith("/cas/"):  # the CAS service: a Xet token, no Hub quota
            if path.startswith("/cas/v1/fetch_term"):  # a presigned URL: no token
                return None, {}
            xet_token = (request.headers.get("authorization") or "").removeprefix("Bearer ")
            user, valid_until = self.xet_tokens.get(xet_token, ("", 0.0))
            if valid_until <= self.clock():
                return JSONResponse({"error": "bad or expired Xet token"}, status_code=401), {}
            if user and request_class(path):
                with self._lock:
                    self._count(user, "cas")
            return None, {}
        if self.fail_status is not None:
            return JSONResponse({"error": "injected failure"}, status_code=self.fail_status), {}
        authorization = request.headers.get("authorization") or ""
        if authorization.removeprefix("Bearer ") not in self.tokens:
            # This message keeps the client from reading a 401 as "repository not found".
            headers = {"X-Error-Message": "Invalid credentials in Authorization header"}
            return JSONResponse({"error": "unauthorized"}, status_code=401, headers=headers), {}
        cls = request_class(path)
        if cls is None:
            return None, {}
        with self._lock:
            left, reset_s, window = self._count(authorization, cls)
            if left < 0:
                window.limited[cls] += 1
        headers = {
            "RateLimit": f'"{cls}";r={max(left, 0)};t={math.ceil(reset_s)}',
            "RateLimit-Policy": f'"fixed window";"{cls}";q={self.quotas[cls]};w={self.window_s:.0f}',
        }
        if left < 0:
            message = f"You have exceeded the rate limit for {cls} requests; retry in {math.ceil(reset_s)} s"
            return JSONResponse({"error": message}, status_code=429, headers=headers), {}
        return None, headers

    def _bucket(self, ns: str, name: str) -> dict[str, dict]:
        try:
            return self.buckets[f"{ns}/{name}"]
        except KeyError:
            # The client maps RepoNotFound on a bucket URL to BucketNotFoundError.
            raise HTTPException(404, headers={"X-Error-Code": "RepoNotFound"}) from None

    def _space(self, ns: str, name: str) -> Space:
        try:
            return self.spaces[f"{ns}/{name}"]
        except KeyError:
            raise HTTPException(404, headers={"X-Error-Code": "RepoNotFound"}) from None

    def _build_app(self) -> FastAPI:
        app = FastAPI()

        app.include_router(self._cas_router(), prefix="/cas")

        app.add_middleware(_Terms, hub=self)

        @app.post("/api/buckets/{ns}/{name}")
        async def create(ns: str, name: str):
            bucket_id = f"{USER if ns == 'me' else ns}/{name}"
            url = f"{self.endpoint}/buckets/{bucket_id}"
            if bucket_id in self.buckets:
                return JSONResponse({"error": "exists", "url": url}, status_code=409)
            self.buckets[bucket_id] = {}
            return {"url": url}

        @app.get("/api/buckets/{ns}/{name}")
        async def info(ns: str, name: str):
            files = self._bucket(ns, name)
            size = sum(f["size"] for f in files.values())
            return {
                "id": f"{ns}/{name}",
                "private": True,
                "createdAt": _iso(0.0),
                "updatedAt": _iso(self.updated_at.get(f"{ns}/{name}", 0.0)),
                "size": size,
                "totalFiles": len(files),
            }

        @app.get("/api/buckets/{ns}/{name}/xet-write-token")
        @app.get("/api/buckets/{ns}/{name}/xet-read-token")
        async def xet_token(ns: str, name: str, request: Request):
            self._bucket(ns, name)
            # On the test clock (hf_xet checks it against the real one: tests' clocks run ahead of it).
            exp = int(self.clock() + self.xet_token_s)
            access = f"xet-{len(self.xet_tokens)}-{secrets.token_hex(8)}"
            self.xet_tokens[access] = (request.headers.get("authorization") or "", exp)
            # hf_xet reads the JSON body; huggingface_hub's own helper reads the headers.
            headers = {
                "X-Xet-Cas-Url": self.cas_url,
                "X-Xet-Access-Token": access,
                "X-Xet-Token-Expiration": str(exp),
            }
            body = {"accessToken": access, "exp": exp, "casUrl": self.cas_url}
            return JSONResponse(body, headers=headers)

        @app.post("/api/buckets/{ns}/{name}/batch")
        async def batch(ns: str, name: str, request: Request):
            files, failed, changes = self._bucket(ns, name), [], []
            ops = [json.loads(line) for line in (await request.body()).decode().splitlines()]
            sizes = {op["xetHash"]: self.size(op["xetHash"]) for op in ops if op["type"] == "addFile"}
            with self._lock:
                now = _iso(self.clock())
                for op in ops:
                    path = op["path"]
                    if op["type"] == "addFile":
                        entry = {
                            "type": "file",
                            "path": path,
                            "xetHash": op["xetHash"],
                            "size": sizes[op["xetHash"]],
                            "mtime": now,
                            "uploadedAt": now,
                        }
                        before = files.get(path)
                        if before is not None:
                            self.previous[(f"{ns}/{name}", path)] = (self.clock(), before)
                        files[path] = entry
                        fields = {k: entry[k] for k in ("path", "size", "xetHash", "uploadedAt", "mtime")}
                        changes.append({**fields, "op": "add" if before is None else "update"})
                    elif op["type"] != "deleteFile" or files.pop(path, None) is None:
                        failed.append({"path": path, "error": f"{op['type']} failed"})
                    else:
                        self.previous.pop((f"{ns}/{name}", path), None)
                        changes.append({"path": path, "op": "delete"})
                if changes:
                    self._record(f"{ns}/{name}", changes)
                lost, status = self._lost
                if lost:
                    self._lost = (lost - 1, status)
            if lost:
                return JSONResponse({"error": "the response was lost"}, status_code=status)
            return {"failed": failed}

        @app.post("/api/buckets/{ns}/{name}/paths-info")
        async def paths_info(ns: str, name: str, request: Request):
            self._bucket(ns, name)
            found = [self.entry(f"{ns}/{name}", p, request) for p in (await request.json())["paths"]]
            return [e for e in found if e is not None]

        @app.get("/api/buckets/{ns}/{name}/tree")
        @app.get("/api/buckets/{ns}/{name}/tree/{prefix:path}")
        async def tree(
            ns: str, name: str, request: Request, prefix: str = "", recursive: bool = False, cursor: int = 0
        ):
            out, folders = [], set()
            for path in sorted(self._bucket(ns, name)):
                if not path.startswith(prefix):  # a plain string prefix, as the client documents
                    continue
                entry = self.entry(f"{ns}/{name}", path, request)
                rest = path[len(prefix) :].lstrip("/")
                if recursive or "/" not in rest:
                    out.append(entry)
                else:
                    folder = path[: len(path) - len(rest)] + rest.split("/")[0]
                    if folder not in folders:
                        folders.add(folder)
                        out.append({"type": "directory", "path": folder, "uploadedAt": entry["uploadedAt"]})
            page, headers = out[cursor : cursor + self.page_size], {}
            if cursor + self.page_size < len(out):  # the next page's URL, as the Hub links it
                query = urlencode({"recursive": recursive, "cursor": cursor + self.page_size})
                headers["Link"] = f'<{str(request.url).split("?")[0]}?{query}>; rel="next"'
            return JSONResponse(page, headers=headers)

        @app.get("/api/buckets/{ns}/{name}/events")
        async def events(ns: str, name: str, request: Request, cursor: str | None = None, since: str = ""):
            bucket = f"{ns}/{name}"
            if not self.feed:
                raise HTTPException(404, "the change feed is not served here")
            if self.feed_status is not None:
                raise HTTPException(self.feed_status, "injected feed failure")
            self._bucket(ns, name)
            with self._lock:
                oldest = self.changes[-self.feed_buffer].seq if len(self.changes) >= self.feed_buffer else 1
                if cursor is not None:
                    if not cursor.isdigit():
                        raise HTTPException(400, "bad cursor")
                    after = int(cursor)
                    if after + 1 < oldest and self.changes:  # older than the replay buffer
                        return _sse([("reset", {"reason": "cursor too old"})])
                    if after > len(self.changes):  # not one of ours (a Hub reset since)
                        return _sse([("reset", {"reason": "unknown cursor"})])
                elif since:
                    t = parse_datetime(since).timestamp()
                    replay = [c for c in self.changes if c.at >= t - 1e-3]
                    after = replay[0].seq - 1 if replay else len(self.changes)
                    if replay and replay[0].seq < oldest:
                        return _sse([("reset", {"reason": "since too old"})])
                else:
                    after = len(self.changes)
            return StreamingResponse(self._stream(bucket, after, request), media_type="text/event-stream")

        @app.post("/api/repos/create")
        async def create_repo(request: Request):
            body = await request.json()
            if body.get("type") != "space":
                raise HTTPException(400, "the fake Hub models Space repos only")
            space_id = f"{body.get('organization') or USER}/{body['name']}"
            url = f"{self.endpoint}/spaces/{space_id}"
            if space_id in self.spaces:
                return JSONResponse({"error": "You already created this repo", "url": url}, status_code=409)
            self.spaces[space_id] = Space(
                sdk=body["sdk"], private=body.get("visibility") == "private", hardware=body.get("hardware")
            )
            return {"url": url}

        @app.post("/api/validate-yaml")
        async def validate_yaml(request: Request):
            # The Hub parses a README's front matter before a commit; the client stops on errors.
            content = (await request.json())["content"]
            if not content.startswith("---\n"):
                return {"errors": [], "warnings": [{"message": "empty or missing yaml metadata"}]}
            try:
                yaml.safe_load(content[4:].split("\n---\n", 1)[0])
            except yaml.YAMLError as e:
                return JSONResponse({"errors": [{"message": str(e)}], "warnings": []}, status_code=400)
            return {"errors": [], "warnings": []}

        @app.post("/api/spaces/{ns}/{name}/preupload/{revision}")
        async def preupload(ns: str, name: str, revision: str, request: Request):
            self._space(ns, name)
            files = (await request.json())["files"]
            modes = [{"path": f["path"], "uploadMode": "regular", "shouldIgnore": False} for f in files]
            return {"files": modes}

        @app.post("/api/spaces/{ns}/{name}/commit/{revision}")
        async def commit(ns: str, name: str, revision: str, request: Request):
            space = self._space(ns, name)
            files = dict(space.files)
            for line in (await request.body()).decode().splitlines():
                item = json.loads(line)
                key, value = item["key"], item["value"]
                if key == "file" and value["encoding"] == "base64":
                    files[value["path"]] = base64.b64decode(value["content"])
                elif key == "deletedFile":
                    files.pop(value["path"], None)
                elif key == "deletedFolder":
                    folder = value["path"].rstrip("/") + "/"
                    files = {p: d for p, d in files.items() if not p.startswith(folder)}
                elif key != "header":
                    raise HTTPException(400, f"commit item {key!r} is not modelled")
            space.files, space.commits = files, space.commits + 1
            oid = hashlib.sha1(f"{ns}/{name}#{space.commits}".encode()).hexdigest()
            return {"commitUrl": f"{self.endpoint}/spaces/{ns}/{name}/commit/{oid}", "commitOid": oid}

        @app.get("/api/spaces/{ns}/{name}/tree/{revision}")
        async def repo_tree(ns: str, name: str, revision: str):
            return [
                {"type": "file", "path": p, "size": len(d), "oid": hashlib.sha1(d).hexdigest()}
                for p, d in sorted(self._space(ns, name).files.items())
            ]

        @app.post("/api/spaces/{ns}/{name}/variables")
        async def add_variable(ns: str, name: str, request: Request):
            space, body = self._space(ns, name), await request.json()
            space.variables[body["key"]] = body["value"]
            return {k: {"value": v} for k, v in space.variables.items()}

        @app.post("/api/spaces/{ns}/{name}/secrets")
        async def add_secret(ns: str, name: str, request: Request):
            body = await request.json()
            self._space(ns, name).secrets[body["key"]] = body["value"]
            return {}

        @app.post("/api/spaces/{ns}/{name}/hardware")
        async def request_hardware(ns: str, name: str, request: Request):
            space = self._space(ns, name)
            space.hardware = (await request.json())["flavor"]
            return {"stage": "BUILDING", "hardware": {"current": None, "requested": space.hardware}}

        @app.api_route("/buckets/{ns}/{name}/resolve/{path:path}", methods=["GET", "HEAD"])
        def resolve(ns: str, name: str, path: str, request: Request):  # off the loop: read() asks /cas
            self._bucket(ns, name)
            entry = self.entry(f"{ns}/{name}", path, request)
            if entry is None:
                return Response(status_code=404, headers={"X-Error-Code": "EntryNotFound"})
            headers = {
                "X-Xet-Hash": entry["xetHash"],
                "X-Linked-Size": str(entry["size"]),
                "X-Xet-Refresh-Route": f"{self.endpoint}/api/buckets/{ns}/{name}/xet-read-token",
            }
            if request.method == "HEAD":
                return Response(headers={**headers, "Content-Length": str(entry["size"])})
            return Response(
                self.read(entry["xetHash"]), headers=headers, media_type="application/octet-stream"
            )

        app.include_router(model_routes(lambda: self.models))  # last: its /{ns}/{name}/... routes are wide
        return app

    def _cas_router(self) -> APIRouter:
        """Xet's CAS API (v1), as xet-core's `RemoteClient` calls it."""
        router = APIRouter()

        @router.post("/v1/xorbs/{prefix}/{xorb_hash}")
        async def upload_xorb(prefix: str, xorb_hash: str, request: Request):
            path = self._xorbs / _hex(xorb_hash)
            inserted = not path.exists()
            if inserted:
                partial = path.with_suffix(f".{id(request)}")  # no reader sees half a xorb
                partial.write_bytes(await request.body())
                partial.replace(path)
            return {"was_inserted": inserted}

        @router.post("/v1/shards")
        async def upload_shard(request: Request):
            files = _shard_files(await request.body())
            missing = sorted(
                {t.xorb for terms in files.values() for t in terms if not (self._xorbs / t.xorb).exists()}
            )
            if missing:  # as the CAS does (hub-docs, xet/api.md: "a referenced Xorb doesn't exist")
                raise HTTPException(
                    400, f"shard references {len(missing)} xorb(s) never uploaded: {missing[0]}"
                )
            with self._lock:
                self._files.update(files)
            return {"result": 1}  # SyncPerformed

        @router.get("/v1/reconstructions/{file_hash}")
        async def reconstruction(file_hash: str, request: Request):
            terms = self._files.get(_hex(file_hash))
            if terms is None:
                raise HTTPException(404, "file not found")
            size = sum(t.unpacked_length for t in terms)
            first, last = _byte_range(request.headers.get("range"), size)
            out, fetch_info, offset, skip = [], collections.defaultdict(list), 0, 0
            for term in terms:  # the terms that overlap [first, last]
                end = offset + term.unpacked_length
                if end > first and offset <= last:
                    skip = first - offset if not out else skip
                    chunks = {"start": term.start, "end": term.end}
                    out.append({"hash": term.xorb, "unpacked_length": term.unpacked_length, "range": chunks})
                    start, stop = self._chunk_bytes(term)
                    url = f"{self.cas_url}/v1/fetch_term?xorb={term.xorb}"
                    url_range = {"start": start, "end": stop - 1}  # inclusive, as the Range header
                    fetch_info[term.xorb].append({"range": chunks, "url": url, "url_range": url_range})
                offset = end
            if size and not out:
                raise HTTPException(416, "range not satisfiable")
            return {"offset_into_first_range": skip, "terms": out, "fetch_info": fetch_info}

        @router.get("/v1/fetch_term")
        async def fetch_term(xorb: str, request: Request):
            data = self._xorb(_hex(xorb))
            first, last = _byte_range(request.headers.get("range"), len(data))
            return Response(data[first : last + 1], status_code=206, media_type="application/octet-stream")

        return router

    async def _stream(self, bucket: str, after: int, request: Request):
        """One feed session: the changes after seq `after` (replay), `ready`, then live changes."""
        started, cursor, changes = self.clock(), after, self.changes

        def batches(upto: int) -> list[bytes]:
            out, pending = [], [c for c in self.changes[cursor:upto] if c.bucket == bucket]
            for _, group in itertools.groupby(pending, key=lambda c: c.batch):  # one event per batch request
                out.append(self._changes_event(list(group)))
            return out

        with self._lock:
            end = len(self.changes)
            replay = batches(end)
        yield b"".join(replay)
        cursor = end
        yield _event("ready", {"cursor": str(cursor)} if cursor else {})
        last_sent = time.monotonic()
        news = asyncio.Event()  # set when a batch lands (or the Hub stops): no polling while nothing changes
        session = (asyncio.get_running_loop(), news)
        self._sessions.add(session)
        try:
            while True:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(news.wait(), self.feed_check_s)
                news.clear()
                if self.closing or changes is not self.changes:
                    return
                if self.fail_status is not None or self.feed_status is not None:
                    return
                if await request.is_disconnected():
                    return
                with self._lock:
                    end = len(self.changes)
                    live = batches(end)
                if live:
                    cursor = end
                    yield b"".join(live)
                    last_sent = time.monotonic()
                elif time.monotonic() - last_sent >= self.keepalive_s:
                    yield b": keep-alive\n\n"
                    last_sent = time.monotonic()
                if self.clock() - started >= self.feed_session_s:
                    yield _event("reconnect", {"cursor": str(cursor)})
                    return
        finally:
            self._sessions.discard(session)


class _Terms:
    """The Hub's terms in front of every route (`FakeHub.admit`), as plain ASGI middleware: Starlette's
    `BaseHTTPMiddleware` would pass every answer, and each event of every feed session, through a stream and
    a task of its own, which a fleet's thousand sessions pay for on every change."""

    def __init__(self, app, hub: FakeHub):
        self.app, self.hub = app, hub

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        request = Request(scope)
        if not request.url.path.startswith("/cas/"):
            self.hub.requests.append(f"{request.method} {request.url.path}")
            while self.hub.stall and not self.hub.closing:
                await asyncio.sleep(0.01)
        refusal, headers = self.hub.admit(request)
        if refusal is not None:
            return await refusal(scope, receive, send)
        if not headers:
            return await self.app(scope, receive, send)

        async def send_with_headers(message) -> None:
            if message["type"] == "http.response.start":
                MutableHeaders(scope=message).update(headers)
            await send(message)

        await self.app(scope, receive, send_with_headers)


@dataclass
class Term:
    """A term of a file's reconstruction: chunks [start, end) of a xorb, `unpacked_length` bytes of it."""

    xorb: str
    unpacked_length: int
    start: int
    end: int


_ENTRY = 48  # every record of a shard's file info section is 48 bytes
_WITH_VERIFICATION, _WITH_METADATA_EXT = 1 << 31, 1 << 30


def _hash_hex(raw: bytes) -> str:
    """A Merkle hash as Xet writes it: four little-endian u64s, each as 16 hex digits."""
    return "".join(f"{int.from_bytes(raw[i : i + 8], 'little'):016x}" for i in range(0, 32, 8))


def _hex(name: str) -> str:
    """`name` if it is a hash's hex (it names a file here), else a 400."""
    if len(name) != 64 or any(c not in "0123456789abcdef" for c in name):
        raise HTTPException(400, "not a Xet hash")
    return name


def _shard_files(shard: bytes) -> dict[str, list[Term]]:
    """The files a shard describes (its file info section, after the 48-byte header, up to the bookend)."""
    files, offset = {}, _ENTRY
    while True:
        file_hash, flags, count = shard[offset : offset + 32], *struct.unpack_from("<II", shard, offset + 32)
        if file_hash == b"\xff" * 32:
            return files
        terms = []
        for i in range(count):
            xorb, (_, unpacked, start, end) = (
                shard[offset + _ENTRY * (i + 1) : offset + _ENTRY * (i + 1) + 32],
                struct.unpack_from("<IIII", shard, offset + _ENTRY * (i + 1) + 32),
            )
            terms.append(Term(_hash_hex(xorb), unpacked, start, end))
        records = 1 + count + (count if flags & _WITH_VERIFICATION else 0) + bool(flags & _WITH_METADATA_EXT)
        files[_hash_hex(file_hash)] = terms
        offset += _ENTRY * records


def _chunk_bytes(xorb: bytes, start: int, end: int) -> tuple[int, int]:
    """Where chunks [start, end) of a xorb lie in it: each chunk is an 8-byte header (its compressed length in
    bytes 1-3) and its compressed bytes."""
    offset, first = 0, 0
    for index in range(end):
        if index == start:
            first = offset
        offset += 8 + int.from_bytes(xorb[offset + 1 : offset + 4], "little")
    return first, offset


def _byte_range(header: str | None, size: int) -> tuple[int, int]:
    """The inclusive byte range of a `Range: bytes=a-b` header (the whole of `size` bytes without one)."""
    if not header:
        return 0, size - 1
    first, _, last = header.removeprefix("bytes=").partition("-")
    return int(first), min(int(last), size - 1) if last else size - 1


def _event(name: str, payload: dict) -> bytes:
    return f"event: {name}\ndata: {json.dumps(payload)}\n\n".encode()


def _sse(events: list[tuple[str, dict]]) -> StreamingResponse:
    body = b"".join(_event(name, payload) for name, payload in events)
    return StreamingResponse(iter([body]), media_type="text/event-stream")
