"""An in-process stand-in for the Hub's bucket API that the real `huggingface_hub` client can talk to offline.

Routes and wire formats follow huggingface_hub 2.4 (`../shared/reference/apis.md`, 1.4 and Appendix A).
File bytes never pass through the fake: its Xet token route answers `casUrl: local://<dir>`, so `hf_xet`
stores and fetches chunks in a local folder itself. The fake reads a file back (to learn its size, or to serve
a plain GET) through the client's own Xet session, and the local CAS is locked per process: the fake must run
in the process that uses the client.

Not modelled: pagination, copies, listing/moving/settings of buckets, the live event feed, visibility, rate
limits.
"""

import json
import socket
import tempfile
import threading
import time
from datetime import UTC, datetime
from pathlib import Path

import uvicorn
from fastapi import FastAPI, HTTPException, Request, Response
from fastapi.responses import JSONResponse

USER = "user"  # whom the token belongs to: the `me` namespace


def _now() -> str:
    # The client's parse_datetime wants exactly this shape (it rejects "+00:00").
    dt = datetime.now(UTC)
    return dt.strftime("%Y-%m-%dT%H:%M:%S.") + f"{dt.microsecond // 1000:03d}Z"


class FakeHub:
    """The Hub at `endpoint`, accepting `token` only. Start with `start()`; tests may set `fail_status`."""

    def __init__(self, cas_dir: Path, token: str = "hf_fake_token"):
        self.token = token
        self.cas_url = f"local://{cas_dir}"
        self.buckets: dict[str, dict[str, dict]] = {}  # bucket id -> path -> file entry (wire format)
        self.requests: list[str] = []  # "METHOD /path" of every request, so tests can count round trips
        self.fail_status: int | None = None  # when set, every request fails with it (an outage)
        self.endpoint = ""
        self._server: uvicorn.Server | None = None
        self.app = self._build_app()

    def reset(self) -> None:
        self.buckets.clear()
        self.requests.clear()
        self.fail_status = None

    def start(self) -> None:
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        self.endpoint = f"http://127.0.0.1:{sock.getsockname()[1]}"
        self._server = uvicorn.Server(uvicorn.Config(self.app, log_level="warning"))
        threading.Thread(target=self._server.run, kwargs={"sockets": [sock]}, daemon=True).start()
        deadline = time.monotonic() + 10
        while not self._server.started:
            if time.monotonic() > deadline:
                raise RuntimeError("fake Hub did not start")
            time.sleep(0.01)

    def stop(self) -> None:
        if self._server is not None:
            self._server.should_exit = True

    def read(self, xet_hash: str) -> bytes:
        """A file's bytes, read back out of the local CAS."""
        import hf_xet
        from huggingface_hub.utils._xet import get_xet_session  # the client's session: no CAS lock clash

        with tempfile.TemporaryDirectory() as tmp:
            dest = Path(tmp) / "file"
            with get_xet_session().new_file_download_group(endpoint=self.cas_url) as group:
                group.start_download_file(hf_xet.XetFileInfo(xet_hash), str(dest))
            return dest.read_bytes()

    def _bucket(self, ns: str, name: str) -> dict[str, dict]:
        try:
            return self.buckets[f"{ns}/{name}"]
        except KeyError:
            # The client maps RepoNotFound on a bucket URL to BucketNotFoundError.
            raise HTTPException(404, headers={"X-Error-Code": "RepoNotFound"}) from None

    def _build_app(self) -> FastAPI:
        app = FastAPI()

        @app.middleware("http")
        async def auth_and_faults(request: Request, call_next):
            self.requests.append(f"{request.method} {request.url.path}")
            if self.fail_status is not None:
                return JSONResponse({"error": "injected failure"}, status_code=self.fail_status)
            if request.headers.get("authorization") != f"Bearer {self.token}":
                # This message keeps the client from reading a 401 as "repository not found".
                headers = {"X-Error-Message": "Invalid credentials in Authorization header"}
                return JSONResponse({"error": "unauthorized"}, status_code=401, headers=headers)
            return await call_next(request)

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
                "createdAt": _now(),
                "size": size,
                "totalFiles": len(files),
            }

        @app.get("/api/buckets/{ns}/{name}/xet-write-token")
        @app.get("/api/buckets/{ns}/{name}/xet-read-token")
        async def xet_token(ns: str, name: str):
            self._bucket(ns, name)
            exp = int(time.time()) + 3600
            # hf_xet reads the JSON body; huggingface_hub's own helper reads the headers.
            headers = {
                "X-Xet-Cas-Url": self.cas_url,
                "X-Xet-Access-Token": "xet",
                "X-Xet-Token-Expiration": str(exp),
            }
            return JSONResponse({"accessToken": "xet", "exp": exp, "casUrl": self.cas_url}, headers=headers)

        @app.post("/api/buckets/{ns}/{name}/batch")
        async def batch(ns: str, name: str, request: Request):
            files, failed = self._bucket(ns, name), []
            for line in (await request.body()).decode().splitlines():
                op = json.loads(line)
                if op["type"] == "addFile":
                    files[op["path"]] = {
                        "type": "file",
                        "path": op["path"],
                        "xetHash": op["xetHash"],
                        "size": len(self.read(op["xetHash"])),
                        "mtime": _now(),
                        "uploadedAt": _now(),
                    }
                elif op["type"] != "deleteFile" or files.pop(op["path"], None) is None:
                    failed.append({"path": op["path"], "error": f"{op['type']} failed"})
            return {"failed": failed}

        @app.post("/api/buckets/{ns}/{name}/paths-info")
        async def paths_info(ns: str, name: str, request: Request):
            files = self._bucket(ns, name)
            return [files[p] for p in (await request.json())["paths"] if p in files]

        @app.get("/api/buckets/{ns}/{name}/tree")
        @app.get("/api/buckets/{ns}/{name}/tree/{prefix:path}")
        async def tree(ns: str, name: str, prefix: str = "", recursive: bool = False):
            out, folders = [], set()
            for path, entry in sorted(self._bucket(ns, name).items()):
                if not path.startswith(prefix):  # a plain string prefix, as the client documents
                    continue
                rest = path[len(prefix) :].lstrip("/")
                if recursive or "/" not in rest:
                    out.append(entry)
                else:
                    folder = path[: len(path) - len(rest)] + rest.split("/")[0]
                    if folder not in folders:
                        folders.add(folder)
                        out.append({"type": "directory", "path": folder, "uploadedAt": entry["uploadedAt"]})
            return out

        @app.api_route("/buckets/{ns}/{name}/resolve/{path:path}", methods=["GET", "HEAD"])
        async def resolve(ns: str, name: str, path: str, request: Request):
            entry = self._bucket(ns, name).get(path)
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

        return app
