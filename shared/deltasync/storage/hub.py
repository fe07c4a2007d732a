"""A sync root in a Hugging Face Hub bucket, through huggingface_hub's bucket API and the bucket change feed.

The Hub counts requests per token in fixed 5-minute windows, per class: API calls (`/api/...`: paths-info,
listings, writes, Xet tokens) and resolver calls (`/buckets/.../resolve/...`: file reads), the latter with a
quota five times larger; Xet's CAS, which holds the bytes, counts against neither. So this backend:
- follows the bucket's change feed (`GET /api/buckets/{id}/events`, through huggingface_hub's own client)
  once a reader waits for changes (`wait_for_change`): every change names its path, size and Xet hash, so
  stats are answered from what the feed said, a read fetches exactly the content the feed announced, by its
  hash, from the CAS (hf_xet, with a read token kept until it expires: one API call per token, no resolver
  call per file), an unchanged file read again costs nothing, and a waiting reader wakes on the change
  itself, with no request while nothing changes;
- without the feed (not served, refused, or down) reads small files (`read_bytes`: heads, deltas,
  telemetry) with one resolver GET, bounded by the caller's limit from the size the answer announces, and
  polls no faster than its `poll_budget` allows;
- writes through the CAS with a write token kept likewise, then one batch call (one API call a write);
- counts what it sends per window and class against its `budget` (its share of the token's quota:
  deltasync.storage.budget), and backs off (`RateLimited`, with no request) before it would go over, or when
  the Hub's `RateLimit` header says the user's window has less than its reserve left; on a 429 it raises
  `RateLimited` with the time the quota's window ends and reports it in `rate_limited_until` instead of
  sleeping inside the call.
"""

from __future__ import annotations

import collections
import json
import math
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import hf_xet
import httpx2
from huggingface_hub import HfApi, get_session
from huggingface_hub.errors import BucketNotFoundError, EntryNotFoundError
from huggingface_hub.utils import build_hf_headers, hf_raise_for_status, parse_ratelimit_headers

from deltasync.storage.base import (
    POLL_BUDGET,
    RateLimited,
    Storage,
    TransientStorageError,
    atomic_file,
    check_path,
    rate_limited_line,
)
from deltasync.storage.budget import RESERVE, Budget
from deltasync.storage.compat import BucketFileChange, Follower

_HUB_MISSING = (BucketNotFoundError, EntryNotFoundError)
WINDOW_S = 300.0  # the Hub's quota window
POLL_REQUESTS = 3  # what one poll costs: the head, the lease and the next delta, each one resolver GET
STAT_TTL_S = 30.0  # a stat not confirmed by the feed is asked again after this (listings lag on the Hub)
MEMO_BYTES = 64 << 10  # files up to this size are kept by Xet hash: reading one again costs nothing
MEMO_FILES = 256
LOG_ENTRIES = 100_000  # changes kept for readers that have not looked yet
FEED_PATHS = 10_000  # paths whose stat and last change are remembered (each root: its head's chain, records)
CONNECT_TIMEOUT_S = 10.0
READ_TIMEOUT_S = 60.0  # between bytes of an answer: a stalled Hub or half-open connection fails the call
XET_TOKEN_MARGIN_S = 60.0  # a Xet token is asked again this long before it expires (as huggingface_hub does)
_xet_session: hf_xet.XetSession | None = (
    None  # the process's Xet runtime and connection pool, made on first use
)
_xet_lock = threading.Lock()


def _xet() -> hf_xet.XetSession:
    global _xet_session
    with _xet_lock:
        if _xet_session is None:
            _xet_session = hf_xet.XetSession()
        return _xet_session


def _class(url: str) -> str:
    """The quota a request of ours counts against."""
    return "api" if "/api/" in url else "resolvers"


@dataclass(frozen=True)
class _Stat:
    size: int
    xet_hash: str


@dataclass(frozen=True)
class _XetToken:
    """A Xet access token for the bucket's CAS, as the Hub's token route answers it."""

    cas_url: str
    access: str
    expires: float  # unix seconds


class _Spend:
    """What one client sent in the current quota window, per class, against its budget."""

    def __init__(self, budget: Budget | None, clock: Callable[[], float]):
        self.budget, self.clock = budget, clock
        self.window = -1
        self.sent: collections.Counter[str] = collections.Counter()
        self.lock = threading.Lock()

    def take(self, cls: str) -> float | None:
        """Count one request of `cls`; or, if the budget has none left, the unix time (on `clock`) its
        window ends, counting nothing."""
        now = self.clock()
        with self.lock:
            window = math.floor(now / WINDOW_S)
            if window != self.window:
                self.window, self.sent = window, collections.Counter()
            if self.budget is not None and self.sent[cls] >= self.budget.of(cls):
                return (window + 1) * WINDOW_S
            self.sent[cls] += 1
            return None


class _Feed:
    """What the change feed says about the bucket's paths, kept by the feed's thread."""

    def __init__(self) -> None:
        self.cond = threading.Condition()
        self.stats: dict[str, tuple[_Stat | None, float]] = {}  # key -> stat (None: absent), expiry
        self.generation = 0  # one more per change: stats asked before a change to their key are dropped
        self.touched: dict[str, int] = {}  # key -> generation of its last change, oldest change first
        self.forgotten = 0  # the newest generation of a key dropped from `touched`
        self.log: list[str] = []  # keys changed, in order ("": anything may have changed)
        self.dropped = 0  # entries trimmed from the log's front
        self.cursors: dict[str, int] = {}  # each consumer's position in the log (counting the dropped)
        self.follower: Follower | None = None
        self.waited_live = False  # whether the feed was live when `wait_for_change` last looked

    def remember(self, key: str, stat: _Stat | None, expires: float) -> None:
        """Keep `key`'s stat, forgetting the oldest kept past FEED_PATHS (asked again when needed)."""
        self.stats.pop(key, None)
        self.stats[key] = (stat, expires)
        while len(self.stats) > FEED_PATHS:
            del self.stats[next(iter(self.stats))]

    def touch(self, key: str) -> None:
        """`key` changed: a new generation. Past FEED_PATHS keys, the one changed longest ago is forgotten
        with its stat, and `changed_since` says of any key not kept that it changed then."""
        self.generation += 1
        self.touched.pop(key, None)
        self.touched[key] = self.generation
        while len(self.touched) > FEED_PATHS:
            oldest = next(iter(self.touched))
            self.forgotten = self.touched.pop(oldest)
            self.stats.pop(oldest, None)
        self.log_change(key)

    def changed_since(self, key: str, generation: int) -> bool:
        """Whether `key` may have changed after `generation`. Call with `cond` held."""
        return self.touched.get(key, self.forgotten) > generation

    def log_change(self, key: str) -> None:
        self.log.append(key)
        if len(self.log) > LOG_ENTRIES:
            half = len(self.log) // 2
            del self.log[:half]
            self.dropped += half

    def news(self, consumer: str) -> list[str] | None:
        """The keys changed since `consumer` last asked, or None if that is not known (a first call, or
        the log lost its place). Call with `cond` held."""
        at = self.cursors.get(consumer)
        self.cursors[consumer] = self.dropped + len(self.log)
        if at is None or at < self.dropped:
            return None
        news = self.log[at - self.dropped :]
        return None if "" in news else news

    @property
    def live(self) -> bool:
        follower = self.follower
        return follower is not None and follower.subscribed and follower.in_session and follower.is_alive()

    def on_changes(self, changes: list[BucketFileChange]) -> None:
        with self.cond:
            for change in changes:
                known, _ = self.stats.get(change.path, (None, 0.0))
                size, xet_hash = change.size, change.xet_hash
                if known is not None:  # an update names only the fields that changed
                    size, xet_hash = size if size is not None else known.size, xet_hash or known.xet_hash
                if change.op == "delete":
                    self.remember(change.path, None, math.inf)
                elif size is not None and xet_hash is not None:
                    self.remember(change.path, _Stat(size, xet_hash), math.inf)
                else:  # not enough to go on: asked when next needed
                    self.stats.pop(change.path, None)
                self.touch(change.path)
            self.cond.notify_all()

    def on_reconcile(self) -> None:
        """The feed lost its place: forget everything, and wake every waiter (anything may have changed)."""
        with self.cond:
            self.stats.clear()
            self.touched.clear()
            self.touch("")
            self.forgotten = self.generation  # every key may have changed: older asked stats are dropped
            self.cond.notify_all()


def _timeout() -> httpx2.Timeout:
    """Every request of ours fails (TransientStorageError) rather than wait for ever on a silent server."""
    return httpx2.Timeout(READ_TIMEOUT_S, connect=CONNECT_TIMEOUT_S)


class HubBucketStorage(Storage):
    """A Hugging Face Hub bucket, or a folder in one, through huggingface_hub's bucket API.

    A write uploads through Xet, then one batch call points the path at the new content, so readers see the
    old or the new file. The bucket is created (private) on the first write. `token` goes to HfApi and the
    requests made here, nowhere else; None means HF_TOKEN or the login cache. `follow=False` never opens the
    change feed; `poll_budget` is the resolver calls per 5-minute window that polling may spend without it;
    `budget` caps everything this client sends (None: only the Hub's own headers hold it back). `clock` tells
    the quota windows and token expiries (a test clock in tests and benchmarks).
    """

    def __init__(
        self,
        bucket_id: str,
        prefix: str = "",
        token: str | None = None,
        follow: bool = True,
        poll_budget: int = POLL_BUDGET,
        budget: Budget | None = None,
        clock: Callable[[], float] = time.time,
    ):
        if poll_budget < 1:
            raise ValueError(f"poll budget must be at least 1 request per window, got {poll_budget}")
        self.bucket_id = check_path(bucket_id)
        self.prefix = check_path(prefix) + "/" if prefix else ""
        self.url = f"hf://buckets/{bucket_id}" + (f"/{prefix}" if prefix else "")
        self.api = HfApi(token=token)
        self._token = token
        self.follow, self.poll_budget = follow, poll_budget
        self._feed = _Feed()
        self._memo: collections.OrderedDict[str, bytes] = collections.OrderedDict()  # xet hash -> content
        self._limited_until = (0.0, 0.0)  # on `clock`, and on the real clock (what callers are told)
        self._lock = threading.Lock()
        self.budget, self.clock = budget, clock
        self._spend = _Spend(budget, clock)
        self._tokens: dict[str, _XetToken] = {}  # "read" / "write" -> the token in use
        self._token_lock = threading.Lock()
        self._group: tuple[_XetToken, hf_xet.XetDownloadStreamGroup] | None = None

    def _key(self, path: str) -> str:
        return self.prefix + path

    # ------------------------------------------------------------------------------ the feed and quotas

    @property
    def live(self) -> bool:
        """Whether the change feed is followed now (stats and waits then cost no request)."""
        return self._feed.live

    @property
    def poll_s(self) -> float:
        """The shortest interval between polls without the feed that keeps within `poll_budget`."""
        return WINDOW_S * POLL_REQUESTS / self.poll_budget

    @property
    def rate_limited_until(self) -> float | None:
        """Unix time (on the real clock, whatever `clock` tells windows by) until which nothing is sent."""
        until, until_real = self._limited_until
        return until_real if until > self.clock() else None

    def wait_for_change(self, stop: threading.Event, poll_s: float, under: tuple[str, ...] = ("",)) -> None:
        self._start_feed()
        feed, keys = self._feed, tuple(self.prefix + u for u in under)
        deadline = time.monotonic() + max(poll_s, self.poll_s)
        with feed.cond:
            while True:
                news, live = feed.news("wait"), feed.live
                # A session began since the waiter last looked: what landed before it was never announced.
                began, feed.waited_live = live and not feed.waited_live, live
                if news is None or began or any(k.startswith(keys) for k in news) or stop.is_set():
                    return
                if not live and time.monotonic() >= deadline:
                    return  # no feed: a poll
                feed.cond.wait(0.25)  # also checks `stop` and whether the feed went down

    def announced(self, path: str) -> bool | None:
        if not self.live:
            return None
        with self._feed.cond:
            stat, _ = self._feed.stats.get(self._key(path), (None, 0.0))
        return stat is not None

    @property
    def follows_changes(self) -> bool:
        follower = self._feed.follower
        return self.follow and (follower is None or follower.is_alive())

    def changes(self, under: str) -> list[str] | None:
        self._start_feed()
        feed, folder = self._feed, self._key(under) + "/"
        with feed.cond:
            news = feed.news(f"changes {under}") if feed.live else None
            if news is None:
                if not feed.live:  # what it logs meanwhile may miss changes: start over once it follows
                    feed.cursors.pop(f"changes {under}", None)
                return None
        keys = dict.fromkeys(k for k in news if k.startswith(folder))
        return [k[len(self.prefix) :] for k in keys]

    def _start_feed(self) -> None:
        with self._lock:
            follower = self._feed.follower
            if not self.follow or (follower is not None and follower.is_alive()):
                return
            if follower is not None and not follower.subscribed:
                return  # it gave up before it ever followed: not served or refused here; poll
            me = weakref.ref(self)
            self._feed.follower = Follower(
                endpoint=self.api.endpoint,
                bucket_id=self.bucket_id,
                token=self._token,
                on_changes=self._feed.on_changes,
                on_reconcile=self._feed.on_reconcile,
                is_alive=lambda: me() is not None,
            )
            self._feed.follower.start()

    def _refuse_while_limited(self) -> None:
        """RateLimited, without a request, while the last 429's window lasts."""
        until = self.rate_limited_until
        if until is not None:
            raise RateLimited(f"{self.url}: {rate_limited_line(until)}", until)

    def _request(
        self, method: str, url: str, headers: dict[str, str] | None = None, **kwargs
    ) -> httpx2.Response:
        """One request of ours (not the client's, which sleeps through a 429 by itself)."""
        self._take(_class(url))
        headers = {**build_hf_headers(token=self._token), **(headers or {})}
        response = get_session().request(method, url, headers=headers, timeout=_timeout(), **kwargs)
        self._check(response)
        return response

    def _take(self, cls: str) -> None:
        """Count a request about to be sent, or refuse it (RateLimited) while a limit lasts or the budget's
        window is spent."""
        self._refuse_while_limited()
        window_end = self._spend.take(cls)
        if window_end is not None:
            self._limit_for(window_end - self.clock())
            self._refuse_while_limited()

    def _limit_for(self, seconds: float) -> None:
        until = self.clock() + seconds
        if until > self._limited_until[0]:
            self._limited_until = (until, time.time() + seconds)

    def _check(self, response: httpx2.Response) -> None:
        limit = parse_ratelimit_headers(response.headers)
        if response.status_code == 429:
            self._limit_for(limit.reset_in_seconds if limit is not None else 60)
            self._refuse_while_limited()
        if limit is not None and limit.limit and limit.remaining <= limit.limit * RESERVE:
            self._limit_for(limit.reset_in_seconds)  # the user's window is nearly spent: before a 429
        if response.status_code >= 400:
            response.read()
            hf_raise_for_status(response)

    # ------------------------------------------------------------------------------------------- stats

    def _stats(self, paths: list[str], resolver: bool = False) -> dict[str, _Stat | None]:
        """Each path's size and Xet hash (None: absent): from the feed where it knows, else one request: a
        paths-info, or with `resolver` a resolver HEAD of the one path (a download's stat, from the quota five
        times the API's: a replica's start stats its anchor)."""
        feed, now, out = self._feed, time.time(), {}
        with feed.cond:
            for p in paths:
                stat, expires = feed.stats.get(self._key(p), (None, 0.0))
                if expires > now:
                    out[p] = stat
            asked_at = feed.generation
        missing = [p for p in paths if p not in out]
        if not missing:
            return out
        live = feed.live
        found = self._resolved(missing[0]) if resolver and len(missing) == 1 else None
        if found is None:
            try:
                answer = self._request(
                    "POST",
                    f"{self.api.endpoint}/api/buckets/{self.bucket_id}/paths-info",
                    json={"paths": [self._key(p) for p in missing]},
                ).json()
            except BucketNotFoundError:
                answer = []
            found = {f["path"]: _Stat(f["size"], f["xetHash"]) for f in answer if f.get("type") == "file"}
        with feed.cond:
            for p in missing:
                out[p] = stat = found.get(self._key(p))
                if live and not feed.changed_since(self._key(p), asked_at):  # else the feed knows better
                    feed.remember(self._key(p), stat, now + STAT_TTL_S)
        return out

    def _resolved(self, path: str) -> dict[str, _Stat] | None:
        """`path`'s stat ({} if absent) from one resolver HEAD, by the size and Xet hash its answer names
        (None: it names neither)."""
        url = f"{self.api.endpoint}/buckets/{self.bucket_id}/resolve/{self._key(path)}"
        self._take("resolvers")
        headers = build_hf_headers(token=self._token)
        # Not redirected: the Hub's answer names the file, the storage's would name its bytes.
        response = get_session().head(url, headers=headers, follow_redirects=False, timeout=_timeout())
        if response.status_code == 404:
            return {}
        self._check(response)
        size, xet_hash = response.headers.get("x-linked-size", ""), response.headers.get("x-xet-hash", "")
        return {self._key(path): _Stat(int(size), xet_hash)} if size.isdigit() and xet_hash else None

    def _sizes(self, paths: list[str]) -> dict[str, int | None]:
        return {p: s.size if s else None for p, s in self._stats(paths).items()}

    def _download_size(self, path: str) -> int | None:
        stat = self._stats([path], resolver=True)[path]
        return stat.size if stat else None

    # ------------------------------------------------------------------------------------------- reads

    def _read_bytes(self, path: str, limit: int | None) -> bytes:
        live, key = self.live, self._key(path)
        with self._feed.cond:
            stat, expires = self._feed.stats.get(key, (None, 0.0))
            known, asked_at = live and expires > time.time(), self._feed.generation
        if known:
            if stat is None:
                raise FileNotFoundError(path)
            if limit is not None:
                self._refuse_over(path, stat.size, limit)
            with self._lock:
                if stat.xet_hash in self._memo:
                    self._memo.move_to_end(stat.xet_hash)
                    return self._memo[stat.xet_hash]
            data, xet_hash = self._cas_read(path, stat), stat.xet_hash  # by content: never stale
        else:  # a path the feed has not announced (or no feed): one resolver GET, whose answer it keeps
            try:
                data, xet_hash = self._get(path, limit)
            except FileNotFoundError:
                self._remember_read(key, None, live, asked_at)
                raise
            if xet_hash and (limit is None or len(data) <= limit):  # the whole file
                self._remember_read(key, _Stat(len(data), xet_hash), live, asked_at)
        if xet_hash and len(data) <= MEMO_BYTES:
            with self._lock:
                self._memo[xet_hash] = data
                while len(self._memo) > MEMO_FILES:
                    self._memo.popitem(last=False)
        return data

    def _remember_read(self, key: str, stat: _Stat | None, live: bool, asked_at: int) -> None:
        """What a resolver read found (None: absent), kept as a stat asked for (STAT_TTL_S), unless the feed
        said otherwise since."""
        if live:
            with self._feed.cond:
                if not self._feed.changed_since(key, asked_at):
                    self._feed.remember(key, stat, time.time() + STAT_TTL_S)

    def _get(self, path: str, limit: int | None) -> tuple[bytes, str]:
        """The content (at most `limit` + 1 bytes) and Xet hash, with one resolver GET."""
        url = f"{self.api.endpoint}/buckets/{self.bucket_id}/resolve/{self._key(path)}"
        headers = build_hf_headers(token=self._token)
        self._take("resolvers")
        stream = get_session().stream("GET", url, headers=headers, follow_redirects=True, timeout=_timeout())
        with stream as response:
            if response.status_code == 404:
                raise FileNotFoundError(path)
            self._check(response)
            size = response.headers.get("x-linked-size") or response.headers.get("content-length")
            if limit is not None and size is not None and size.isdigit():
                self._refuse_over(path, int(size), limit)
            chunks, read = [], 0
            for chunk in response.iter_bytes():
                chunks.append(chunk)
                read += len(chunk)
                if limit is not None and read > limit:
                    break  # the caller refuses it: never read more
            return b"".join(chunks), response.headers.get("x-xet-hash", "")

    def _download_file(self, path: str, local: Path) -> None:
        # By the Xet hash of a stat (from the feed where it knows: no request), not by path.
        stat = self._stats([path], resolver=True)[path]
        if stat is None:
            raise FileNotFoundError(f"{self.url}/{path}")
        with atomic_file(local) as tmp, open(tmp, "wb") as f:
            self._cas_read(path, stat, f.write)

    # --------------------------------------------------------------------------------------- Xet's CAS

    def _xet_token(self, kind: str, stale: _XetToken | None = None) -> _XetToken:
        """The bucket's Xet `kind` ("read" or "write") token: asked (one API call) only when none is kept,
        the kept one expires within XET_TOKEN_MARGIN_S, or it is `stale` (the CAS refused it)."""
        with self._token_lock:
            token = self._tokens.get(kind)
            if token is None or token == stale or token.expires - XET_TOKEN_MARGIN_S <= self.clock():
                url = f"{self.api.endpoint}/api/buckets/{self.bucket_id}/xet-{kind}-token"
                body = self._request("GET", url).json()
                token = _XetToken(body["casUrl"], body["accessToken"], float(body["exp"]))
                self._tokens[kind] = token
            return token

    def _download_group(self, token: _XetToken) -> hf_xet.XetDownloadStreamGroup:
        """hf_xet's connection to the CAS with `token`: made once per token."""
        with self._token_lock:
            if self._group is None or self._group[0] != token:
                group = _xet().new_download_stream_group(
                    endpoint=token.cas_url, token=token.access, token_expiry_unix_secs=int(token.expires)
                )
                self._group = (token, group)
            return self._group[1]

    def _cas_read(self, path: str, stat: _Stat, sink: Callable[[bytes], object] | None = None) -> bytes:
        """The file `stat` names, by its Xet hash, from the CAS: returned, or handed to `sink` chunk by chunk.
        A read that comes short (hf_xet ends a stream early on a refused token) is tried once with a new
        token; no Hub quota is spent but on the token."""
        if stat.size == 0:
            return b""
        token = None
        for attempt in range(2):
            token = self._xet_token("read", stale=token)
            chunks, read = [], 0
            try:
                group = self._download_group(token)
                for chunk in group.download_stream(hf_xet.XetFileInfo(stat.xet_hash, stat.size)):
                    read += len(chunk)
                    if read > stat.size:
                        break
                    chunks.append(chunk) if sink is None else sink(chunk)
            except Exception as e:  # hf_xet's errors name no class of ours: the CAS failed or refused
                if attempt:
                    raise TransientStorageError(f"{self.url}: reading {path} from Xet failed: {e}") from None
                continue
            if read == stat.size:
                return b"".join(chunks)
            if sink is not None:
                break  # the caller's file holds part of it: the caller starts over
        raise TransientStorageError(f"{self.url}: {path} came {read} bytes long from Xet, not {stat.size}")

    def _list(self, prefix: str) -> list[str]:
        # The server may match the prefix as a plain string ("run1" also matches "run10/..."): filter here.
        folder = (self.prefix + prefix).rstrip("/")
        try:
            entries = list(self.api.list_bucket_tree(self.bucket_id, folder or None, recursive=True))
        except _HUB_MISSING:
            return []
        return [
            e.path[len(self.prefix) :] for e in entries if e.type == "file" and e.path.startswith(self.prefix)
        ]

    # ------------------------------------------------------------------------------------------ writes

    def probe(self) -> None:
        try:  # any HTTP answer means reachable; huggingface_hub's own calls retry connection errors for ~25 s
            get_session().head(self.api.endpoint, timeout=10)
        except Exception as e:
            raise TransientStorageError(f"{self.url}: cannot reach {self.api.endpoint}: {e}") from None

    def _upload(self, sources: list[bytes | Path]) -> list[_Stat]:
        """Each source's bytes into the CAS (no Hub quota but the write token's); tried once more with a new
        token if the CAS refuses (or fails)."""
        token = None
        for attempt in range(2):
            self._refuse_while_limited()
            token = self._xet_token("write", stale=token)
            try:
                with _xet().new_upload_commit(
                    endpoint=token.cas_url, token=token.access, token_expiry_unix_secs=int(token.expires)
                ) as commit:
                    handles = [
                        commit.start_upload_bytes(s, sha256=hf_xet.SKIP_SHA256)
                        if isinstance(s, bytes)
                        else commit.start_upload_file(str(s), sha256=hf_xet.SKIP_SHA256)
                        for s in sources
                    ]
                return [_Stat(info.file_size, info.hash) for info in (h.result().xet_info for h in handles)]
            except Exception as e:  # hf_xet's errors name no class of ours: the CAS failed or refused
                if attempt:
                    raise TransientStorageError(f"{self.url}: uploading to Xet failed: {e}") from None
        raise AssertionError("unreachable")

    def _batch(self, add: list[tuple[bytes | Path, str]], delete: list[str]) -> None:
        """One batch call (deleting what is already gone is no failure), after uploading the adds' bytes.
        What this process wrote is news to its own readers at once; what the feed said of those paths before
        the call is old, what it said since (its event may beat the call's answer) is kept."""
        self._refuse_while_limited()
        keys = [self._key(p) for _, p in add] + [self._key(p) for p in delete]
        try:
            stats = self._upload([source for source, _ in add]) if add else []
        except BucketNotFoundError:  # created on the first write that needs it (a replica's never does)
            self.api.create_bucket(self.bucket_id, private=True, exist_ok=True)
            stats = self._upload([source for source, _ in add])
        mtime = int(time.time() * 1000)
        ops = [
            {"type": "addFile", "path": key, "xetHash": stat.xet_hash, "mtime": mtime}
            for key, stat in zip(keys, stats, strict=False)  # keys: the adds', then the deletes'
        ]
        ops += [{"type": "deleteFile", "path": k} for k in keys[len(add) :]]
        with self._feed.cond:
            issued = self._feed.generation
        try:
            answer = self._request(
                "POST",
                f"{self.api.endpoint}/api/buckets/{self.bucket_id}/batch",
                headers={"Content-Type": "application/x-ndjson"},
                content=b"".join(json.dumps(op).encode() + b"\n" for op in ops),
            ).json()
            failed = [f for f in answer.get("failed", []) if f.get("path") not in keys[len(add) :]]
            if failed:  # an add failed
                raise TransientStorageError(f"{self.url}: the Hub refused {failed[0].get('path')}: {failed}")
        finally:  # also after an error: the write may have landed
            with self._feed.cond:
                for key in keys:
                    said_since = self._feed.changed_since(key, issued)
                    if not (said_since and self._feed.stats.get(key, (None, 0.0))[1] == math.inf):
                        self._feed.stats.pop(key, None)
                    self._feed.touch(key)
                self._feed.cond.notify_all()

    def _write_many(self, files: list[tuple[str, bytes | Path]], delete: list[str]) -> None:
        self._batch([(source, path) for path, source in files], delete)

    def _write_bytes(self, path: str, data: bytes) -> None:
        self._batch([(data, path)], [])

    def _upload_file(self, local: Path, path: str) -> None:
        self._batch([(local, path)], [])

    def _delete(self, paths: list[str]) -> None:
        # The batch reports paths that are already gone as failures: delete only those present.
        present = [p for p, size in self._sizes(paths).items() if size is not None]
        if present:
            self._batch([], present)
