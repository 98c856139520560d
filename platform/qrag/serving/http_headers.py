"""Headers the retrieval service drops from requests and adds to its web page. A module of its
own (no imports) so that Serve's HTTP proxy can load it without the library's heavy imports."""

# Headers with which a client could lift Serve's request timeout or its disconnect handling.
STRIPPED_HEADERS = (b"x-request-timeout-seconds", b"x-request-disconnect-disabled")

# The web page loads only its own script and style, and may not be framed.
PAGE_HEADERS = {
    "content-security-policy": "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
    "connect-src 'self'; "
    "frame-ancestors 'none'; base-uri 'none'; form-action 'none'",
    "x-frame-options": "DENY",
    "referrer-policy": "no-referrer",
    "cross-origin-opener-policy": "same-origin",
}


def strip_headers(headers) -> list[tuple[bytes, bytes]]:
    """ASGI ``scope["headers"]`` without the :data:`STRIPPED_HEADERS` (any letter case)."""
    return [(k, v) for k, v in headers or [] if k.lower() not in STRIPPED_HEADERS]
