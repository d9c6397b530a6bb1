"""Who may change things, and how a state change proves it comes from the console's own pages:
the admin token (bearer, or basic password), the form's CSRF token (an HMAC, under a key only the
server holds, of the random value in the browser's cookie), the request's origin, and the one
kind of form body the pages send."""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import secrets
from urllib.parse import parse_qsl

from starlette.datastructures import MultiDict
from starlette.requests import Request

CSRF_COOKIE = "outbox_console_csrf"
CSRF_FIELD = "csrf"
CSRF_NONCE_LENGTH = 43  # secrets.token_urlsafe(32)
_URLSAFE = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_")
MAX_FORM_BYTES = 256 * 1024

Form = MultiDict


async def read_form(request: Request) -> Form | None:
    """An urlencoded form body (the only kind the pages send), ``None`` when it is another
    kind, too big or not UTF-8."""
    content_type = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if content_type != "application/x-www-form-urlencoded":
        return None
    body = b""
    async for chunk in request.stream():
        body += chunk
        if len(body) > MAX_FORM_BYTES:
            return None
    try:
        return MultiDict(parse_qsl(body.decode("utf-8"), keep_blank_values=True))
    except (UnicodeDecodeError, ValueError):
        return None


def csrf_key(admin_token: str | None) -> bytes:
    """The key form tokens are signed with, which never leaves the server, so a value planted
    in the cookie (a sibling subdomain can set one: it is same-site) has no valid token.
    Derived from the admin token, every replica behind one address verifies the others'
    tokens; without one no change is possible and a random key does."""
    if admin_token is None:
        return secrets.token_bytes(32)
    return hmac.new(
        admin_token.encode("utf-8"), b"outbox console csrf key", hashlib.sha256
    ).digest()


def csrf_signature(key: bytes, nonce: str) -> str:
    """The form token for the cookie's ``nonce``: ``base64url(HMAC-SHA256(key, nonce))``."""
    digest = hmac.new(key, b"outbox console csrf\x00" + nonce.encode("ascii"), hashlib.sha256)
    return base64.urlsafe_b64encode(digest.digest()).rstrip(b"=").decode("ascii")


def is_nonce(value: str | None) -> bool:
    return value is not None and len(value) == CSRF_NONCE_LENGTH and set(value) <= _URLSAFE


def own_origin(request: Request) -> str:
    """The origin the console's pages were served from, as a browser states it in ``Origin``."""
    return f"{request.url.scheme}://{request.headers.get('host', '')}".lower()


def from_own_origin(request: Request) -> tuple[bool, str]:
    """Whether a state change comes from the console's own pages, and what said otherwise.

    Browsers send ``Origin`` with every POST (``Sec-Fetch-Site`` too, in current ones); a
    client that sends neither is no browser, so no credentials a browser keeps are at stake
    and the CSRF token alone decides. An opaque ``Origin: null`` without ``Sec-Fetch-Site``
    is refused.
    """
    origin = request.headers.get("origin")
    site = request.headers.get("sec-fetch-site")
    if origin is not None and (origin.strip().lower() != "null" or site is None):
        return origin.strip().lower() == own_origin(request), f"Origin {origin[:80]!r}"
    # An opaque origin ("null": a page whose referrer policy hides it, or a sandboxed frame)
    # says nothing; the browser's Sec-Fetch-Site still tells a same-origin form from others.
    if site is not None:
        return site.strip().lower() == "same-origin", f"Sec-Fetch-Site {site[:40]!r}"
    return True, ""


def carries_token(authorization: str | None, token: str | None) -> bool:
    """True when an ``Authorization`` header carries ``token`` (bearer, or basic password)."""
    if not token or not authorization:
        return False
    scheme, _, credentials = authorization.strip().partition(" ")
    credentials = credentials.strip()
    if scheme.lower() == "bearer":
        offered = credentials
    elif scheme.lower() == "basic":
        try:
            decoded = base64.b64decode(credentials, validate=True).decode("utf-8")
        except (binascii.Error, UnicodeDecodeError):
            return False
        offered = decoded.partition(":")[2]
    else:
        return False
    return hmac.compare_digest(offered.encode("utf-8"), token.encode("utf-8"))
