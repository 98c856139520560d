"""API keys of the retrieval service: ``key:scope`` pairs (scope ``read`` or ``write``; write
implies read) from ``$QRAG_API_KEYS`` and the config, kept only as SHA-256 digests."""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import os

SCOPES = ("read", "write")
ENV = "QRAG_API_KEYS"


class ApiKeyError(ValueError):
    """A malformed key list; the message never repeats a key."""


def digest(key: str) -> str:
    return hashlib.sha256(key.encode("utf-8")).hexdigest()


def parse_keys(spec: str | None, where: str) -> dict[str, str]:
    """'key:scope,key:scope' -> {sha256(key): scope}."""
    table: dict[str, str] = {}
    for i, item in enumerate(p.strip() for p in (spec or "").split(",")):
        if not item:
            continue
        key, sep, scope = item.rpartition(":")
        if not sep or not key or scope not in SCOPES:
            raise ApiKeyError(f"{where}: entry {i + 1} is not 'key:read' or 'key:write'")
        if any(ch.isspace() for ch in key):
            raise ApiKeyError(f"{where}: entry {i + 1}: a key cannot contain whitespace")
        table[digest(key)] = scope
    return table


def key_table(config_keys: str | None, environ: dict[str, str] | None = None) -> dict[str, str]:
    """Digest -> scope of every configured key ($QRAG_API_KEYS and the ``api_keys`` field)."""
    env = os.environ if environ is None else environ
    table = parse_keys(env.get(ENV), f"${ENV}")
    table.update(parse_keys(config_keys, "api_keys"))
    return table


def scope_of(table: dict[str, str], authorization: str | None) -> str | None:
    """The scope of an ``Authorization: Bearer <key>`` header, or None when it names no key."""
    if not authorization:
        return None
    kind, _, key = authorization.strip().partition(" ")
    if kind.lower() != "bearer" or not key.strip():
        return None
    d = digest(key.strip())
    for known, scope in table.items():  # constant time per entry: no timing hint of a near miss
        if hmac.compare_digest(known, d):
            return scope
    return None


def allows(scope: str | None, needed: str) -> bool:
    return scope == "write" or (scope == "read" and needed == "read")


def is_loopback(host: str) -> bool:
    """True for addresses only this machine reaches (127.0.0.0/8, ::1, localhost)."""
    host = host.strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def startup_problem(host: str, table: dict[str, str], allow_unauthenticated: bool) -> str | None:
    """Why the service must not start: reachable from other machines with no key configured."""
    if table or allow_unauthenticated or is_loopback(host):
        return None
    return (
        f"refusing to serve on {host} without API keys: "
        "anyone who reaches the port could delete or overwrite every corpus. "
        f"Set ${ENV}='<key>:write,<key>:read' (or the api_keys field from a secret), bind 127.0.0.1, "
        f"or set allow_unauthenticated: true"
    )
