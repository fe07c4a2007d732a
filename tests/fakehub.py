"""An in-process stand-in for the Hub's bucket API that the real `huggingface_hub` client can talk to offline.

Routes and wire formats follow huggingface_hub 2.4's bucket client (`huggingface_hub.hf_api`, `_buckets`).
File bytes never pass through the fake: its Xet token route answers `casUrl: local://<dir>`, so `hf_xet`
stores and fetches chunks in a local folder itself. The fake reads a file back (to learn its size, or to serve
a plain GET) through the client's own Xet session, and the local CAS is locked per process: the fake must run
in the process that uses the client.

Space repos (for the deploy command): create, README metadata validation, commits of regular (base64) files,
the file tree, variables, secrets and hardware requests. Files are kept in memory.

Not modelled: pagination, copies, listing/moving/settings of buckets, the live event feed, visibility, rate
limits; LFS/Xet files in repos (preupload answers "regular" for every file), model and dataset repos, Space
runtimes and builds.
"""

import base64
import contextlib
import hashlib
import json
import tempfile
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

import yaml
from fastapi import FastAPI, HTTPException, Request, Response
from fastapi.responses import JSONResponse

from trainer.processes import serving_in_thread

USER = "user"  # whom the token belongs to: the `me` namespace


def _now() -> str:
    # The client's parse_datetime wants exactly this shape (it rejects "+00:00").
    dt = datetime.now(UTC)
    return dt.strftime("%Y-%m-%dT%H:%M:%S.") + f"{dt.microsecond // 1000:03d}Z"


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
        self.cas_url = f"local://{cas_dir}"
        self.buckets: dict[str, dict[str, dict]] = {}  # bucket id -> path -> file entry (wire format)
        self.spaces: dict[str, Space] = {}  # Space id -> what was created, committed and configured
        self.requests: list[str] = []  # "METHOD /path" of every request, so tests can count round trips
        self.fail_status: int | None = None  # when set, every request fails with it (an outage)
        self.endpoint = ""
        self._serving = contextlib.ExitStack()
        self.app = self._build_app()

    def reset(self) -> None:
        self.buckets.clear()
        self.spaces.clear()
        self.requests.clear()
        self.fail_status = None

    def start(self) -> None:
        self.endpoint = self._serving.enter_context(serving_in_thread(self.app))

    def stop(self) -> None:
        self._serving.close()

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

    def _space(self, ns: str, name: str) -> Space:
        try:
            return self.spaces[f"{ns}/{name}"]
        except KeyError:
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
