"""How every app reads its configuration: one typed pydantic-settings class per app, filled from the
environment (field `poll_s` <- variable `POLL_S`), secrets as `SecretStr` so no repr or log shows them.

    class Settings(BaseSettings):
        sync_root: str
        poll_s: float = 1.0

    settings = from_env(Settings)   # one clear line and exit status 2 when a variable is missing or malformed
"""

from __future__ import annotations

from typing import TypeVar

from pydantic import ValidationError
from pydantic_settings import BaseSettings

S = TypeVar("S", bound=BaseSettings)


def from_env(cls: type[S]) -> S:
    """`cls()` read from the environment; a missing or malformed variable exits with one line naming it."""
    try:
        return cls()
    except ValidationError as e:
        problems = "; ".join(
            f"{'.'.join(map(str, err['loc'])).upper()}: {err['msg']}"
            for err in e.errors(include_input=False)
            if err["type"] != "default_factory_not_called"  # a consequence of another error
        )
        raise SystemExit(f"bad configuration (environment variables): {problems}") from None
