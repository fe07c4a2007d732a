"""Model repositories on the fake Hub (tests/fakehub.py serves these routes beside its buckets).

What huggingface_hub 2.4's `model_info` and `hf_hub_download` ask for:
`GET /api/models/{repo}[/revision/{rev}]` (the commit sha and the file names), and
`HEAD`/`GET /{repo}/resolve/{rev}/{file}` (a regular file: its commit in `X-Repo-Commit`, its git blob id as
ETag, its size). A revision is a branch or a commit sha; a commit's files never change, a branch moves with
each commit to it, and `forget` drops a commit as a force-push does.
Errors as the Hub answers them: 404 with `X-Error-Code` RepoNotFound, RevisionNotFound or EntryNotFound.
Requests count against the fake Hub's quotas as any other (`/api/`: api, `/resolve/`: resolvers).

Not modelled: LFS or Xet files in model repos (every file is a regular one), tags, pull-request refs, repos
without a namespace.
"""

import hashlib
import itertools
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse
from huggingface_hub import constants


@dataclass
class ModelRepo:
    commits: dict[str, dict[str, bytes]] = field(default_factory=dict)  # sha -> path -> bytes
    branches: dict[str, str] = field(default_factory=dict)  # branch -> sha


class ModelRepos:
    """The fake Hub's model repositories (empty at each FakeHub.reset)."""

    def __init__(self) -> None:
        self.repos: dict[str, ModelRepo] = {}
        self.fail_status: int | None = None  # when set, the model routes alone fail with it (an outage)
        self._serial = itertools.count()

    def commit(self, repo: str, files: dict[str, bytes], branch: str = "main") -> str:
        """Commit `files` (the whole tree) to `branch` of `repo` (created if new); returns the commit sha."""
        sha = hashlib.sha1(f"{repo}:{next(self._serial)}".encode()).hexdigest()
        model = self.repos.setdefault(repo, ModelRepo())
        model.commits[sha] = dict(files)
        model.branches[branch] = sha
        return sha

    def forget(self, repo: str, sha: str) -> None:
        """Drop the commit `sha` (history rewritten): asking for it answers RevisionNotFound."""
        del self.repos[repo].commits[sha]

    def tree(self, repo: str, revision: str) -> tuple[str, dict[str, bytes]] | Response:
        """The commit `revision` names in `repo` and its files, or the Hub's 404 (or `fail_status`)."""
        if self.fail_status is not None:
            return Response(b"injected failure", status_code=self.fail_status)
        model = self.repos.get(repo)
        if model is None:
            return _not_found("RepoNotFound", f"Repository {repo} not found")
        sha = model.branches.get(revision, revision)
        if sha not in model.commits:
            return _not_found("RevisionNotFound", f"Invalid rev id: {revision}")
        return sha, model.commits[sha]


def client_on(hub, monkeypatch, cache: Path) -> None:
    """Point this process's huggingface_hub at the fake Hub `hub` for model files too (it builds their URLs
    from the endpoint it found at import; the `fake_hub` fixture sets the rest), with its cache in `cache`."""
    template = hub.endpoint + "/{repo_id}/resolve/{revision}/{filename}"
    monkeypatch.setattr(constants, "HUGGINGFACE_CO_URL_TEMPLATE", template)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))


def _not_found(code: str, message: str) -> Response:
    return JSONResponse({"error": message}, status_code=404, headers={"X-Error-Code": code})


def model_routes(repos: Callable[[], ModelRepos]) -> APIRouter:
    """The routes of `repos()` (looked up per request: a reset replaces it)."""
    router = APIRouter()

    @router.get("/api/models/{ns}/{name}")
    @router.get("/api/models/{ns}/{name}/revision/{revision}")
    async def model_info(ns: str, name: str, revision: str = "main"):
        found = repos().tree(f"{ns}/{name}", revision)
        if isinstance(found, Response):
            return found
        sha, files = found
        siblings = [{"rfilename": path} for path in sorted(files)]
        return {
            "id": f"{ns}/{name}",
            "modelId": f"{ns}/{name}",
            "sha": sha,
            "private": False,
            "siblings": siblings,
        }

    @router.api_route("/{ns}/{name}/resolve/{revision}/{path:path}", methods=["GET", "HEAD"])
    async def resolve(ns: str, name: str, revision: str, path: str, request: Request):
        found = repos().tree(f"{ns}/{name}", revision)
        if isinstance(found, Response):
            return found
        sha, files = found
        if path not in files:
            return _not_found("EntryNotFound", f"{path} does not exist on {revision}")
        data = files[path]
        blob = hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()  # git's id of the file
        headers = {"X-Repo-Commit": sha, "ETag": f'"{blob}"', "Content-Length": str(len(data))}
        body = b"" if request.method == "HEAD" else data
        return Response(body, headers=headers, media_type="application/octet-stream")

    return router
