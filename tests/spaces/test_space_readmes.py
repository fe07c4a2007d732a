"""Each Space README's front matter against the Hub's Spaces configuration reference
(https://huggingface.co/docs/hub/spaces-config-reference): known keys only, each of its type and allowed
values; `short_description` within the 60 characters the Hub accepts (its upload error: "length must be less
than or equal to 60 characters long"); a Docker Space's `app_port` is the port its Dockerfile serves."""

import re
import unicodedata
from pathlib import Path

import pytest

from tests.helpers import REPO
from trainer.deploy import APPS, front_matter

COLORS = {"red", "yellow", "green", "blue", "indigo", "purple", "pink", "gray"}
HEADERS = ("cross-origin-embedder-policy", "cross-origin-opener-policy", "cross-origin-resource-policy")
HARDWARE = {
    "cpu-basic", "cpu-upgrade", "t4-small", "t4-medium", "l4x1", "l4x4", "l40sx1", "l40sx4", "l40sx8",
    "a10g-small", "a10g-large", "a10g-largex2", "a10g-largex4", "a100-large", "a100x4", "a100x8",
}  # fmt: skip
SHORT_DESCRIPTION_MAX = 60


def is_str_list(value) -> bool:
    return isinstance(value, list) and all(isinstance(v, str) for v in value)


def is_emoji(value) -> bool:
    """Emoji characters only (symbols, with the joiners and variation selectors that compose them)."""
    joiners = {"\u200d", "\ufe0f", "\ufe0e"}
    return (
        isinstance(value, str)
        and bool(value)
        and all(unicodedata.category(c) in ("So", "Sk") or c in joiners for c in value)
    )


# key -> (what the reference says it is, check)
RULES = {
    "title": ("a string", lambda v: isinstance(v, str) and v.strip() != ""),
    "emoji": ("emoji only", is_emoji),
    "colorFrom": (f"one of {sorted(COLORS)}", lambda v: v in COLORS),
    "colorTo": (f"one of {sorted(COLORS)}", lambda v: v in COLORS),
    "sdk": ("gradio, docker or static", lambda v: v in ("gradio", "docker", "static")),
    "python_version": ("3.x or 3.x.x", lambda v: isinstance(v, str) and re.fullmatch(r"3\.\d+(\.\d+)?", v)),
    "sdk_version": ("a string", lambda v: isinstance(v, str)),
    "suggested_hardware": ("a hardware flavor", lambda v: v in HARDWARE),
    "suggested_storage": ("small, medium or large", lambda v: v in ("small", "medium", "large")),
    "app_file": ("a path", lambda v: isinstance(v, str)),
    "app_build_command": ("a string", lambda v: isinstance(v, str)),
    "app_port": ("a port number", lambda v: type(v) is int and 0 < v < 65536),
    "base_path": ("a path starting with /", lambda v: isinstance(v, str) and v.startswith("/")),
    "fullWidth": ("a boolean", lambda v: isinstance(v, bool)),
    "header": ("mini or default", lambda v: v in ("mini", "default")),
    "short_description": (
        f"a string of at most {SHORT_DESCRIPTION_MAX} characters",
        lambda v: isinstance(v, str) and 0 < len(v) <= SHORT_DESCRIPTION_MAX,
    ),
    "models": ("a list of strings", is_str_list),
    "datasets": ("a list of strings", is_str_list),
    "tags": ("a list of strings", is_str_list),
    "thumbnail": ("a URL", lambda v: isinstance(v, str) and v.startswith("https://")),
    "pinned": ("a boolean", lambda v: isinstance(v, bool)),
    "hf_oauth": ("a boolean", lambda v: isinstance(v, bool)),
    "hf_oauth_scopes": ("a list of strings", is_str_list),
    "hf_oauth_expiration_minutes": ("minutes, at most 43200", lambda v: type(v) is int and 0 < v <= 43200),
    "hf_oauth_authorized_org": ("a string or a list", lambda v: isinstance(v, str) or is_str_list(v)),
    "disable_embedding": ("a boolean", lambda v: isinstance(v, bool)),
    "startup_duration_timeout": ("a duration like 30m or 1h", lambda v: re.fullmatch(r"\d+[smhd]", str(v))),
    "custom_headers": (
        "lowercase COEP/COOP/CORP headers",
        lambda v: (
            isinstance(v, dict)
            and all(k in HEADERS and isinstance(x, str) and x == x.lower() for k, x in v.items())
        ),
    ),
    "preload_from_hub": ("a list of strings", is_str_list),
}


def problems(meta: dict) -> list[str]:
    """What in `meta` the configuration reference does not allow, one line each."""
    found = [f"{key}: not a Spaces configuration key" for key in meta if key not in RULES]
    found += [
        f"{key}: {meta[key]!r} is not {what}"
        for key, (what, check) in RULES.items()
        if key in meta and not check(meta[key])
    ]
    for key in ("title", "emoji", "colorFrom", "colorTo", "sdk", "short_description"):
        if key not in meta:
            found.append(f"{key}: missing (the Space card shows it)")
    if "app_port" in meta and meta.get("sdk") != "docker":
        found.append("app_port: used only by Docker Spaces")
    return found


def dockerfile_port(dockerfile: Path) -> int:
    """The port a Space's Dockerfile serves: its EXPOSE."""
    return int(re.search(r"^EXPOSE\s+(\d+)", dockerfile.read_text(), re.M).group(1))


@pytest.mark.parametrize("app", APPS)
def test_front_matter_follows_the_reference(app):
    meta = front_matter(REPO / "spaces" / app / "README.md")
    assert problems(meta) == [], app
    if meta["sdk"] == "docker":
        assert meta.get("app_port", 7860) == dockerfile_port(REPO / "spaces" / app / "Dockerfile")


def test_the_rules_catch_what_the_hub_refuses():
    good = {"title": "t", "emoji": "📈", "colorFrom": "blue", "colorTo": "green", "sdk": "docker"}
    assert problems({**good, "short_description": "x" * 60}) == []
    assert problems({**good, "short_description": "x" * 61, "colorTo": "teal", "emoji": "ok", "port": 1}) == [
        "port: not a Spaces configuration key",
        "emoji: 'ok' is not emoji only",
        f"colorTo: 'teal' is not one of {sorted(COLORS)}",
        f"short_description: {'x' * 61!r} is not a string of at most 60 characters",
    ]
