"""Signed roots: the trainer's key, not write access to the bucket, decides what replicas apply.

A signing publisher signs run.json and every head with an Ed25519 key (`cryptography`). The signature rides
in the manifest it signs, as its `signature` field::

    "signature": {"key": "ed25519:<public key, base64>", "value": "<signature, base64>"}

over the manifest's canonical JSON without that field (sorted keys, no spaces), prefixed by what it is
(`deltasync run.json`, `deltasync head`) so that one can never stand for the other. A signed head names
each of its files with its SHA-256 (`Entry.sha256`) and its run (`Head.run`); run.json's `signing` names
the run (a random id and when it began, which orders runs against a restored older one) and the chain of
keys that signed it, oldest first: the last signs the run's heads, each endorses the next (rotation).

A replica's `Trust` holds the keys it was given (none: it trusts whoever can write the bucket) and accepts
a run.json whose chain starts at one of them, then heads signed by the chain's last key::

    key = SigningKey.generate()          # deltasync keygen
    trust = Trust([key.public])          # the replica's --trusted-key / TRUSTED_KEYS
    run = trust.run(signed_run_json)     # ManifestError, one line, for anything else

Only the signature check lives here; what is older than what (rollback) is the subscriber's to decide.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import json
import os
import time
import uuid
from collections.abc import Iterable
from dataclasses import replace
from pathlib import Path
from typing import Any

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from deltasync.errors import ManifestError
from deltasync.sync.protocol import HEAD_PATH, RUN_PATH, Head, RunInfo, Signing

KEY_PREFIX = "ed25519:"
RUN_CONTEXT = b"deltasync run.json\n"
HEAD_CONTEXT = b"deltasync head\n"
ENDORSE_CONTEXT = b"deltasync next key\n"


def parse_public_key(line: str) -> Ed25519PublicKey:
    """A public key from its one-line form `ed25519:<base64 of 32 bytes>`; ValueError saying what is wrong."""
    text = line.strip()
    if not text.startswith(KEY_PREFIX):
        raise ValueError(f"{text[:60]!r} is not a public key: it must start with {KEY_PREFIX!r}")
    try:
        raw = base64.b64decode(text[len(KEY_PREFIX) :], validate=True)
    except binascii.Error:
        raw = b""
    if len(raw) != 32:
        raise ValueError(f"{text[:60]!r} is not a public key: {KEY_PREFIX} and the base64 of 32 bytes")
    return Ed25519PublicKey.from_public_bytes(raw)


def key_line(key: Ed25519PublicKey) -> str:
    raw = key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    return KEY_PREFIX + base64.b64encode(raw).decode()


def short(key: str) -> str:
    """A key as people compare them in logs and on the dashboard: its first characters."""
    return key[: len(KEY_PREFIX) + 10] + "…"


def parse_keys(text: str) -> list[str]:
    """Public keys from a setting: lines or a comma-separated list of `ed25519:...` keys, or paths of files
    holding them (`deltasync keygen` writes `<key>.pub`). ValueError naming the one that is not a key."""
    keys = []
    for item in text.replace(",", "\n").split():
        line = item if item.startswith(KEY_PREFIX) else _read_key_file(item)
        keys.append(key_line(parse_public_key(line)))
    return keys


def _read_key_file(path: str) -> str:
    try:
        return Path(path).read_text()[:1000]
    except OSError as e:
        raise ValueError(
            f"{path[:100]!r} is neither a public key ({KEY_PREFIX}...) nor a key file: {e}"
        ) from None


def sha256_of(data: bytes | Path) -> str:
    """The hex SHA-256 of a file (its bytes, or a local file read in blocks): what a signed head names."""
    if isinstance(data, Path):
        with data.open("rb") as f:
            return hashlib.file_digest(f, "sha256").hexdigest()
    return hashlib.sha256(data).hexdigest()


def canonical(document: dict[str, Any]) -> bytes:
    """The bytes a signature covers: the JSON document without its `signature`, keys sorted, no spaces."""
    unsigned = {k: v for k, v in document.items() if k != "signature"}
    return json.dumps(unsigned, sort_keys=True, separators=(",", ":"), allow_nan=False).encode()


class SigningKey:
    """The trainer's private key. Its file is PKCS#8 PEM, readable by its owner only; `public` is the line
    replicas are given."""

    def __init__(self, private: Ed25519PrivateKey):
        self._private = private
        self.public = key_line(private.public_key())

    @classmethod
    def generate(cls) -> SigningKey:
        return cls(Ed25519PrivateKey.generate())

    @classmethod
    def load(cls, path: str | Path) -> SigningKey:
        """The key in `path`; ValueError, one line, if it is none (or not Ed25519)."""
        try:
            private = serialization.load_pem_private_key(Path(path).read_bytes(), password=None)
        except (OSError, ValueError, TypeError) as e:
            raise ValueError(f"{path}: not a private key file written by `deltasync keygen`: {e}") from None
        if not isinstance(private, Ed25519PrivateKey):
            raise ValueError(f"{path}: a {type(private).__name__}, not an Ed25519 private key")
        return cls(private)

    def save(self, path: str | Path) -> Path:
        """Write the private key to `path` (owner read/write only) and the public key line to `path`.pub;
        returns the latter. FileExistsError, before anything is written, if either exists."""
        pem = self._private.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )
        private, public = Path(path), Path(f"{path}.pub")
        for file in (private, public):  # both checked first: never half a pair
            if file.exists() or file.is_symlink():
                raise FileExistsError(f"{file} exists: keygen never replaces a key (move it, or pass --out)")
        for file, data, mode in ((public, self.public.encode() + b"\n", 0o644), (private, pem, 0o600)):
            with os.fdopen(os.open(file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode), "wb") as f:
                f.write(data)
        return public

    def sign(self, data: bytes, context: bytes) -> bytes:
        """The manifest `data` (JSON) with its signature, as the publisher writes it."""
        document = json.loads(data)
        value = self._private.sign(context + canonical(document))
        document["signature"] = {"key": self.public, "value": base64.b64encode(value).decode()}
        return json.dumps(document, indent=1).encode()

    def endorse(self, key: str) -> str:
        """This key's statement that `key` signs after it (run.json's chain of keys)."""
        return base64.b64encode(self._private.sign(ENDORSE_CONTEXT + key.encode())).decode()


def verified(data: bytes, context: bytes, keys: Iterable[str], what: str) -> tuple[bytes, str]:
    """The canonical bytes of the manifest `data` and the key that signed it, if one of `keys` did; else
    ManifestError naming what is wrong. The canonical bytes are what a reader parses: exactly what was
    signed."""
    try:
        document = json.loads(data)
    except (ValueError, RecursionError):
        raise ManifestError(f"{what}: not JSON") from None
    signature = document.get("signature") if isinstance(document, dict) else None
    if signature is None:
        raise ManifestError(f"{what}: unsigned, and this replica trusts only signed steps")
    if not (
        isinstance(signature, dict)
        and isinstance(signature.get("key"), str)
        and isinstance(signature.get("value"), str)
    ):
        raise ManifestError(f"{what}: the signature is not {{'key': ..., 'value': ...}}")
    key = signature["key"]
    if key not in set(keys):
        raise ManifestError(f"{what}: signed by {short(key)!r:.40}, a key this replica does not trust")
    body = canonical(document)
    if not _valid(key, signature["value"], context + body):
        raise ManifestError(f"{what}: the signature of {short(key)} does not match its content")
    return body, key


def _valid(key: str, value: str, message: bytes) -> bool:
    try:
        parse_public_key(key).verify(base64.b64decode(value, validate=True), message)
    except (ValueError, binascii.Error, InvalidSignature):
        return False
    return True


def endorsed(chain: list[str], endorsements: list[str], trusted: Iterable[str]) -> str | None:
    """The last key of `chain` if the chain, from its first trusted key on, endorses each next key; else
    None."""
    trusted = set(trusted)
    start = next((i for i, key in enumerate(chain) if key in trusted), None)
    if start is None or len(endorsements) != len(chain) - 1:
        return None
    for i in range(start, len(chain) - 1):
        if not _valid(chain[i], endorsements[i], ENDORSE_CONTEXT + chain[i + 1].encode()):
            return None
    return chain[-1]


class Trust:
    """What a replica trusts to say which weights it serves: the keys it was given (`parse_keys`), or with
    none, whoever can write the bucket (every manifest is read as it is, signed or not)."""

    def __init__(self, keys: Iterable[str] = ()):
        self.keys = tuple(key_line(parse_public_key(k)) for k in keys)

    def __str__(self) -> str:
        if not self.keys:
            return "the bucket (no trusted keys: anyone who can write it)"
        return "keys " + ", ".join(map(short, self.keys))

    def run(self, data: bytes) -> RunInfo:
        """run.json from `data`: with keys, only one signed by its chain's last key, the chain starting at a
        trusted key (ManifestError otherwise)."""
        run = RunInfo.from_json(data)
        if not self.keys:
            return run
        if run.signing is None:
            raise ManifestError(f"{RUN_PATH}: unsigned, and this replica trusts only signed runs")
        signer = endorsed(list(run.signing.keys), list(run.signing.endorsements), self.keys)
        if signer is None:
            chain = ", ".join(map(short, run.signing.keys))
            raise ManifestError(f"{RUN_PATH}: its keys ({chain}) descend from no key this replica trusts")
        body, _ = verified(data, RUN_CONTEXT, [signer], RUN_PATH)
        return RunInfo.from_json(body)

    def head(self, data: bytes, run: RunInfo) -> Head:
        """The head from `data`: with keys, only one that `run`'s current key signed for that run, naming
        each of its files' digests (ManifestError otherwise)."""
        if not self.keys:
            return Head.from_json(data)
        assert run.signing is not None  # Trust.run refused it otherwise
        body, _ = verified(data, HEAD_CONTEXT, run.signing.keys[-1:], HEAD_PATH)
        head = Head.from_json(body)
        if head.run != run.signing.run:
            raise ManifestError(
                f"{HEAD_PATH}: signed for run {head.run or 'none'}, not run {run.signing.run}"
            )
        unhashed = [e.step for e in head.entries if e.files and e.sha256 is None]
        if unhashed:
            raise ManifestError(f"{HEAD_PATH}: entries of steps {unhashed[:5]} name files without digests")
        return head


class RunSigner:
    """The publisher's side: signs its run.json and heads with `key`. `previous`, the key that signed the run
    so far, endorses `key` in run.json's chain (rotation); replicas that trust either follow."""

    def __init__(self, key: SigningKey, previous: SigningKey | None = None):
        self.key, self.previous = key, previous

    @classmethod
    def load(cls, key: str | None, previous: str | None = None) -> RunSigner | None:
        """The signer of key files `key` and `previous` (PublisherConfig's); None without a key."""
        if key is None:
            if previous is not None:
                raise ValueError("previous_signing_key rotates to a signing_key: give both")
            return None
        return cls(SigningKey.load(key), SigningKey.load(previous) if previous else None)

    def start(self, run: RunInfo) -> RunInfo:
        """`run` as a new signed run: a fresh id, begun now, signed by `key` (endorsed by `previous`)."""
        chain = (self.previous.public,) if self.previous else ()
        endorsements = (self.previous.endorse(self.key.public),) if self.previous else ()
        signing = Signing(uuid.uuid4().hex, time.time(), (*chain, self.key.public), endorsements)
        return replace(run, signing=signing)

    def resume(self, run: RunInfo, data: bytes) -> RunInfo:
        """The run read as `data`, as this signer goes on signing it: as it is if `key` signs it, with `key`
        added to its chain if `previous` does, signed from now on if it was not. ValueError, one line, for
        a run another key signs (or whose run.json does not verify)."""
        if run.signing is None:
            return self.start(run)
        ours = [self.key.public, *([self.previous.public] if self.previous else [])]
        try:
            Trust(ours).run(data)
        except ManifestError as e:
            raise ValueError(
                f"{e}: pass the run's signing key (and previous_signing_key to rotate)"
            ) from None
        signing = run.signing
        if signing.keys[-1] == self.key.public:
            return run
        assert self.previous is not None and signing.keys[-1] == self.previous.public  # verified above
        endorsement = self.previous.endorse(self.key.public)
        rotated = replace(
            signing, keys=(*signing.keys, self.key.public), endorsements=(*signing.endorsements, endorsement)
        )
        return replace(run, signing=rotated)

    def run_json(self, run: RunInfo) -> bytes:
        return self.key.sign(run.to_json(), RUN_CONTEXT)

    def head_json(self, head: Head) -> bytes:
        return self.key.sign(head.to_json(), HEAD_CONTEXT)

    def signed(self, data: bytes, run: RunInfo) -> bool:
        """Whether the head `data` is one this run's key signed (else another writer's: not the run's)."""
        try:
            Trust([self.key.public]).head(data, run)
        except ManifestError:
            return False
        return True
