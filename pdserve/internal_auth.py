"""The closed internal plane: the shared secret of the router, prefill and decode processes.

One secret, given to every process of a deployment as a file or an environment variable:

    PDSERVE_INTERNAL_SECRET_FILE   path of a file holding it (surrounding whitespace stripped)
    PDSERVE_INTERNAL_SECRET        the secret itself (used when no file is named)

A secret is 16 to 4096 printable ASCII characters without spaces (it travels in a gRPC header),
e.g. `python -c 'import secrets; print(secrets.token_urlsafe(32))'`. A file that is named but
missing, empty or not such a secret is an error, never "no secret": the plane fails closed.

What the secret does:
- gRPC (`pdserve.rpc`): every call carries `authorization: Bearer <secret>`; a server that has
  a secret refuses any other call with UNAUTHENTICATED before its handler runs.
- Redis (`pdserve.registry`): instance and prefix-owner values carry an HMAC-SHA256 of the key
  and the value, under a key derived from the secret; readers drop values that do not verify.

`FROM_ENV` is the default of every `secret=` argument: "whatever `load_internal_secret()` says".
An explicit `None` means no secret (no auth, unsigned registry values).
"""

from __future__ import annotations

import contextlib
import enum
import hashlib
import hmac
import json
import logging
import os
import time
from pathlib import Path

import grpc

SECRET_FILE_ENV = "PDSERVE_INTERNAL_SECRET_FILE"
SECRET_ENV = "PDSERVE_INTERNAL_SECRET"
REDIS_PASSWORD_FILE_ENV = "PDSERVE_REDIS_PASSWORD_FILE"
REDIS_PASSWORD_ENV = "PDSERVE_REDIS_PASSWORD"
AUTH_METADATA_KEY = "authorization"  # gRPC metadata keys are lower case
MIN_SECRET_CHARS, MAX_SECRET_CHARS = 16, 4096
_REGISTRY_KEY_LABEL = b"pdserve registry signing key v1"


class _Default(enum.Enum):
    FROM_ENV = "from the environment"


FROM_ENV = _Default.FROM_ENV
SecretArg = bytes | None | _Default


def _read_setting(file_env: str, value_env: str) -> tuple[str, str] | None:
    """(where it came from, the text) of a setting given as a file or a value, else None."""
    path = os.environ.get(file_env)
    if path:
        try:
            return f"{file_env}={path}", Path(path).read_text().strip()
        except OSError as e:
            raise ValueError(f"{file_env}={path}: cannot read it ({e.strerror or e})") from None
    value = os.environ.get(value_env)
    return (value_env, value.strip()) if value else None


def check_secret(secret: bytes, source: str = "the internal secret") -> bytes:
    """`secret` when it is 16-4096 printable ASCII characters without spaces; else ValueError
    (naming `source`, never the value)."""
    if not MIN_SECRET_CHARS <= len(secret) <= MAX_SECRET_CHARS:
        raise ValueError(
            f"{source}: the secret must be {MIN_SECRET_CHARS} to {MAX_SECRET_CHARS} characters, "
            f"got {len(secret)}"
        )
    if any(not 0x21 <= b <= 0x7E for b in secret):
        raise ValueError(f"{source}: the secret must be printable ASCII without spaces")
    return secret


def load_internal_secret() -> bytes | None:
    """The internal secret from PDSERVE_INTERNAL_SECRET_FILE, else PDSERVE_INTERNAL_SECRET; None
    when neither is set (or the variable is empty). ValueError for a file that cannot be read or
    a secret that `check_secret` refuses."""
    found = _read_setting(SECRET_FILE_ENV, SECRET_ENV)
    if found is None:
        return None
    source, text = found
    if not text:
        raise ValueError(f"{source}: the file is empty")
    return check_secret(text.encode(), source)


def resolve_secret(secret: SecretArg) -> bytes | None:
    """A `secret=` argument made concrete: FROM_ENV -> `load_internal_secret()`."""
    if secret is FROM_ENV:
        return load_internal_secret()
    return None if secret is None else check_secret(bytes(secret))


def load_redis_password() -> str | None:
    """The Redis password from PDSERVE_REDIS_PASSWORD_FILE, else PDSERVE_REDIS_PASSWORD; None
    when neither is set. ValueError for a named file that cannot be read or is empty."""
    found = _read_setting(REDIS_PASSWORD_FILE_ENV, REDIS_PASSWORD_ENV)
    if found is None:
        return None
    source, text = found
    if not text:
        raise ValueError(f"{source}: the file is empty")
    return text


class RateLimitedWarning:
    """Logs a warning at most once every `every_s` seconds, counting the ones left out."""

    def __init__(self, logger: logging.Logger, every_s: float = 30.0) -> None:
        self.logger = logger
        self.every_s = every_s
        self._last = -float("inf")
        self._suppressed = 0

    def __call__(self, message: str, *args: object) -> None:
        now = time.monotonic()
        if now - self._last < self.every_s:
            self._suppressed += 1
            return
        if self._suppressed:
            message += f" (and {self._suppressed} more like it since the last warning)"
        self._last, self._suppressed = now, 0
        self.logger.warning(message, *args)


# ---- gRPC
def auth_metadata(secret: bytes | None) -> tuple[tuple[str, str], ...] | None:
    """The metadata a client adds to every call (None without a secret)."""
    return None if secret is None else ((AUTH_METADATA_KEY, "Bearer " + secret.decode()),)


def is_authorized(metadata: object, secret: bytes) -> bool:
    """Whether gRPC invocation metadata (pairs of key, value) carries `Bearer <secret>`."""
    for key, value in metadata or ():
        if key != AUTH_METADATA_KEY or not isinstance(value, str):
            continue
        scheme, _, token = value.partition(" ")
        if scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), secret):
            return True
    return False


class CallGate:
    """The server side of the secret: `check` aborts a gRPC call that does not carry it."""

    def __init__(self, secret: bytes | None) -> None:
        self.secret = secret
        self._warn = RateLimitedWarning(logging.getLogger("pdserve.rpc"))

    async def check(self, context: grpc.aio.ServicerContext, method: str) -> None:
        if self.secret is None or is_authorized(context.invocation_metadata(), self.secret):
            return
        self._warn("refused %s from %s: missing or wrong internal secret", method, context.peer())
        await context.abort(
            grpc.StatusCode.UNAUTHENTICATED,
            f"{method} needs the internal secret (PDSERVE_INTERNAL_SECRET_FILE or "
            "PDSERVE_INTERNAL_SECRET on the caller): missing or wrong",
        )


# ---- Redis values
def registry_signing_key(secret: bytes) -> bytes:
    """The HMAC key of registry values: derived, so a value's MAC never is the bearer token's."""
    return hmac.new(secret, _REGISTRY_KEY_LABEL, hashlib.sha256).digest()


def sign(signing_key: bytes, redis_key: str, value: str) -> str:
    """Hex HMAC-SHA256 of `value` bound to `redis_key` (a value copied to another key fails)."""
    message = redis_key.encode() + b"\n" + value.encode()
    return hmac.digest(signing_key, message, "sha256").hex()  # one call into OpenSSL: 2-3x hmac.new's


def verify(signing_key: bytes, redis_key: str, value: str, signature: object) -> bool:
    return isinstance(signature, str) and hmac.compare_digest(sign(signing_key, redis_key, value), signature)


def seal_value(signing_key: bytes | None, redis_key: str, value: str) -> str:
    """What to store at `redis_key`: `value` itself without a key, else its signed envelope."""
    if signing_key is None:
        return value
    envelope = {"value": value, "hmac": sign(signing_key, redis_key, value)}
    return json.dumps(envelope, separators=(",", ":"))


def open_value(signing_key: bytes | None, redis_key: str, stored: str) -> str | None:
    """The value stored at `redis_key`. Without a key: the envelope's value or the text as is.
    With one: the envelope's value when its signature verifies, else None."""
    envelope = None
    if stored.startswith("{"):
        with contextlib.suppress(ValueError):
            parsed = json.loads(stored)
            if isinstance(parsed, dict) and parsed.keys() == {"value", "hmac"}:
                envelope = parsed
    if signing_key is None:
        return stored if envelope is None else str(envelope["value"])
    if envelope is None or not isinstance(envelope["value"], str):
        return None
    return envelope["value"] if verify(signing_key, redis_key, envelope["value"], envelope["hmac"]) else None
