"""The console's ASGI app (Starlette + Jinja2 templates): :func:`create_app`.

Safe by default:

* Read-only unless the app has an admin token and the request carries it (``Authorization:
  Bearer TOKEN``, or HTTP basic with the token as password and any user name). Pages show
  no action buttons to anyone else, and every state change refuses them with 403.
* Every state change is a POST from the console's own origin (``Origin``, or
  ``Sec-Fetch-Site`` where a browser sends no ``Origin``) whose form carries the CSRF token:
  an HMAC, under a key only the server holds, of the random value in the browser's
  ``SameSite=Strict`` cookie. A cookie planted from a sibling host, with a form token of its
  own choosing, does not verify; a form posted from another origin is refused; both with 403.
* Every value goes through Jinja's autoescape; URLs are shown redacted, header values whose
  names say secret are hidden.
* A filter or an id that does not parse is a 400 with a message; a database that does not
  answer is a 503; neither shows a traceback.
* Each admin action is logged on ``outbox.console``: what, how many rows, from which address.
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import hashlib
import hmac
import logging
import secrets
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import parse_qsl, urlencode

import jinja2
import sqlalchemy as sa
from markupsafe import Markup
from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.datastructures import MultiDict
from starlette.requests import Request
from starlette.responses import HTMLResponse, PlainTextResponse, RedirectResponse, Response
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles
from starlette.templating import Jinja2Templates

from outbox import admin
from outbox._core.deadletter_reading import choose_letters, describe_stop, format_cursor
from outbox._core.lag import GroupLags
from outbox._core.outage import Outage
from outbox._core.redact import redact_text, redact_url
from outbox._core.settings import check_bootstrap_servers, check_seconds
from outbox._core.urls import check_database_url, check_redis_url
from outbox._kafka.lag import read_group_lags
from outbox._pg import console as console_sql
from outbox.config import normalize_database_url
from outbox.console import chart, data
from outbox.errors import ConfigurationError, OutboxError, ValidationError
from outbox.schema import validate_schema_name

log = logging.getLogger("outbox.console")

HERE = Path(__file__).resolve().parent
CSRF_COOKIE = "outbox_console_csrf"
CSRF_FIELD = "csrf"
CSRF_NONCE_LENGTH = 43  # secrets.token_urlsafe(32)
_URLSAFE = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_")
MIN_TOKEN_LENGTH = 16
REFRESH_SECONDS = 10
SAMPLE_SECONDS = 10.0
MAX_FORM_BYTES = 256 * 1024
# The consumer groups' lag: how long the broker may take, and how long an answer is reused (a
# refreshing page, or many open ones, ask the broker at most this often).
LAG_TIMEOUT = 3.0
LAG_CACHE_SECONDS = 5.0
MAX_COUNT_BUDGET = 60.0

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


@dataclass(frozen=True)
class ConsoleConfig:
    """What the console reads and who may change things."""

    database_url: str
    schema: str | None = None
    bootstrap_servers: str | None = None
    redis_url: str | None = None
    admin_token: str | None = field(default=None, repr=False)
    kafka_config: Mapping[str, str] = field(default_factory=dict, repr=False)
    # Dead letters still to handle that one dead-letters page reads (handled ones do not count).
    dead_letters_limit: int = data.MAX_DEAD_LETTERS

    # The longest a page waits for an exact count of the pending rows: a count that took
    # longer is shown as of when it was made, and the next ones run in the background.
    count_budget: float = data.DEFAULT_COUNT_BUDGET

    def validate(self) -> ConsoleConfig:
        check_database_url(self.database_url)
        check_seconds("count_budget", self.count_budget, MAX_COUNT_BUDGET, zero=True)
        if type(self.dead_letters_limit) is not int or not (
            1 <= self.dead_letters_limit <= 10 * data.MAX_DEAD_LETTERS
        ):
            raise ConfigurationError(
                f"dead_letters_limit: an integer from 1 to {10 * data.MAX_DEAD_LETTERS}"
            )
        validate_schema_name(self.schema)
        if self.bootstrap_servers is not None:
            check_bootstrap_servers(self.bootstrap_servers, "bootstrap_servers")
        if self.redis_url is not None:
            check_redis_url(self.redis_url)
        if self.admin_token is not None and (
            len(self.admin_token) < MIN_TOKEN_LENGTH or not self.admin_token.isprintable()
        ):
            raise ConfigurationError(
                f"the admin token must be at least {MIN_TOKEN_LENGTH} printable characters: "
                "make one with `python -c 'import secrets; print(secrets.token_urlsafe())'`"
            )
        return self


ConsoleSettings = ConsoleConfig
"""The earlier name of :class:`ConsoleConfig`, still importable."""


def csrf_signature(key: bytes, nonce: str) -> str:
    """The form token for the cookie's ``nonce``: ``base64url(HMAC-SHA256(key, nonce))``."""
    digest = hmac.new(key, b"outbox console csrf\x00" + nonce.encode("ascii"), hashlib.sha256)
    return base64.urlsafe_b64encode(digest.digest()).rstrip(b"=").decode("ascii")


def _is_nonce(value: str | None) -> bool:
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


class Console:
    """The app's state: settings, one small engine, the templates."""

    def __init__(self, settings: ConsoleConfig) -> None:
        self.settings = settings.validate()
        self.schema = validate_schema_name(settings.schema)
        self.engine = sa.create_engine(
            normalize_database_url(settings.database_url),
            pool_size=2,
            max_overflow=2,
            pool_pre_ping=True,
            connect_args={"connect_timeout": 5, "application_name": "outbox console"},
        )
        # Every value is escaped: an event value holding <script> shows as text.
        environment = jinja2.Environment(
            loader=jinja2.FileSystemLoader(str(HERE / "templates")), autoescape=True
        )
        environment.filters["warning"] = data.warning_html
        self.templates = Jinja2Templates(env=environment)
        self.samples = chart.Samples()
        # Form tokens are signed with a key that never leaves the server, so a value planted
        # in the cookie (a sibling subdomain can set one: it is same-site) has no valid token.
        # Derived from the admin token, every replica behind one address verifies the
        # others' tokens; without one no change is possible and a random key does.
        admin_token = settings.admin_token
        self._csrf_key = (
            hmac.new(
                admin_token.encode("utf-8"), b"outbox console csrf key", hashlib.sha256
            ).digest()
            if admin_token is not None
            else secrets.token_bytes(32)
        )
        self._stop = threading.Event()
        self._lag_lock = threading.Lock()
        self._lag: tuple[float, GroupLags] | None = None
        self.database_outage = Outage("PostgreSQL")
        self._outage_lock = threading.Lock()
        # The last exact count of the pending rows (with the monotonic time it began), and
        # whether one is running in the background.
        self._count_lock = threading.Lock()
        self._count: tuple[float, admin.PendingCount] | None = None
        self._counting = False

    # -- the pending rows' count ---------------------------------------------------------

    def pending_count(self, connection: sa.Connection, lanes: int) -> admin.PendingCount:
        """The pending rows per topic and lane for the overview (data.pending_count_plan):
        counted on ``connection`` (the page's snapshot), or the last count, with a fresh one
        started in the background when it is due."""
        with self._count_lock:
            last = self._count
            now, background = data.pending_count_plan(
                None if last is None else last[1].lanes,
                lanes,
                0.0 if last is None else last[1].seconds,
                0.0 if last is None else time.monotonic() - last[0],
                self.settings.count_budget,
                self._counting,
            )
            if background:
                self._counting = True
        if now or last is None:
            started = time.monotonic()
            count = admin.count_pending(connection, self.schema, lanes)
            self._keep(started, count)
            return count
        if background:
            threading.Thread(
                target=self._count_in_background, args=(lanes,), name="outbox-console-count",
                daemon=True,
            ).start()  # fmt: skip
        return last[1]

    def _keep(self, started: float, count: admin.PendingCount) -> None:
        with self._count_lock:
            if self._count is None or self._count[1].counted_at <= count.counted_at:
                self._count = (started, count)

    def _count_in_background(self, lanes: int) -> None:
        try:
            with self.engine.connect().execution_options(
                isolation_level="REPEATABLE READ", postgresql_readonly=True
            ) as conn:
                started = time.monotonic()
                count = admin.count_pending(conn, self.schema, lanes)
                conn.rollback()
            self._keep(started, count)
        except sa.exc.DBAPIError as exc:
            self.database_failed(exc)
        finally:
            with self._count_lock:
                self._counting = False

    def group_lags(self) -> GroupLags | None:
        """The consumer groups' lag (``None`` without a broker), at most
        :data:`LAG_CACHE_SECONDS` old; one request at a time reads it from the broker."""
        bootstrap = self.settings.bootstrap_servers
        if bootstrap is None:
            return None
        with self._lag_lock:
            now = time.monotonic()
            if self._lag is None or now - self._lag[0] >= LAG_CACHE_SECONDS:
                lags = read_group_lags(bootstrap, self.settings.kafka_config, LAG_TIMEOUT)
                if lags.error is not None:
                    log.warning("consumer groups' lag: %s", lags.error)
                self._lag = (time.monotonic(), lags)
            return self._lag[1]

    # -- the relayed-per-minute samples --------------------------------------------------

    def sample(self) -> None:
        """Record the outbox table's cumulative deletes (errors are logged, never raised)."""
        try:
            with self.engine.connect() as conn:
                deleted = console_sql.outbox_rows_deleted(conn, self.schema)
                conn.rollback()
        except sa.exc.DBAPIError as exc:
            self.database_failed(exc)
            return
        self.database_answered()
        if deleted is not None:
            self.samples.add(time.time(), deleted)

    def database_failed(self, exc: sa.exc.DBAPIError) -> None:
        """Log an unreachable database once when it goes away and in a summary while it stays
        away (outbox._core.outage), never a traceback per sample or per request."""
        reason = redact_text(str(exc.orig or exc)).strip().splitlines()
        with self._outage_lock:
            line = self.database_outage.failed(
                type(exc.orig or exc).__name__, reason[0] if reason else "", time.monotonic()
            )
        if line:
            log.warning("%s", line)

    def database_answered(self) -> None:
        with self._outage_lock:
            line = self.database_outage.recovered(time.monotonic())
        if line:
            log.info("%s", line)

    def _sampler(self) -> None:
        while not self._stop.wait(SAMPLE_SECONDS):
            self.sample()

    def start_sampling(self) -> None:
        self.sample()
        threading.Thread(target=self._sampler, name="outbox-console-sampler", daemon=True).start()

    def stop_sampling(self) -> None:
        self._stop.set()

    # -- requests ------------------------------------------------------------------------

    def is_admin(self, request: Request) -> bool:
        return carries_token(request.headers.get("authorization"), self.settings.admin_token)

    def csrf_token(self, request: Request) -> str:
        """The form token of this browser's cookie (a new cookie when it has none)."""
        nonce = request.cookies.get(CSRF_COOKIE)
        if not _is_nonce(nonce):
            nonce = getattr(request.state, "new_csrf", None) or secrets.token_urlsafe(32)
            request.state.new_csrf = nonce
        assert nonce is not None
        return csrf_signature(self._csrf_key, nonce)

    def csrf_verified(self, request: Request, offered: object) -> bool:
        nonce = request.cookies.get(CSRF_COOKIE)
        if not isinstance(offered, str) or not offered.isascii() or not _is_nonce(nonce):
            return False
        assert nonce is not None
        expected = csrf_signature(self._csrf_key, nonce)
        return hmac.compare_digest(offered.encode("ascii"), expected.encode("ascii"))

    def page(
        self, request: Request, name: str, context: dict[str, Any], status: int = 200
    ) -> Response:
        admin_now = self.is_admin(request)
        response: Response = self.templates.TemplateResponse(
            request,
            name,
            {
                "admin": admin_now,
                "admin_possible": self.settings.admin_token is not None,
                "done": data.done_message(request.query_params.get("done")),
                "csrf": self.csrf_token(request) if admin_now else "",
                "database": redact_url(self.settings.database_url),
                "refresh": None,
                **context,
            },
            status_code=status,
        )
        # Nothing runs on these pages but their own stylesheet; none may be framed.
        response.headers["Content-Security-Policy"] = (
            "default-src 'self'; script-src 'none'; frame-ancestors 'none'; form-action 'self'"
        )
        response.headers["X-Content-Type-Options"] = "nosniff"
        # No address leaves for another site; the console's own forms keep their Origin
        # (under no-referrer a browser sends "Origin: null" with them).
        response.headers["Referrer-Policy"] = "same-origin"
        new = getattr(request.state, "new_csrf", None)
        if new:
            response.set_cookie(CSRF_COOKIE, new, httponly=True, samesite="strict", path="/")
        return response

    def error(self, request: Request, status: int, message: str) -> Response:
        return self.page(request, "error.html", {"status": status, "message": message}, status)

    async def admin_form(self, request: Request) -> Form | Response:
        """The form of a state change, or the refusal (403) when it may not be made."""
        if not self.is_admin(request):
            why = (
                "this console is read-only: it was started without --admin-token"
                if self.settings.admin_token is None
                else "changes need the admin token (HTTP basic or bearer): sign in as admin"
            )
            return self.error(request, 403, why)
        same, said = from_own_origin(request)
        if not same:
            return self.error(
                request,
                403,
                f"the request came from another site ({said}): changes are accepted only from "
                f"the console's own pages at {own_origin(request)}",
            )
        form = await read_form(request)
        if form is None:
            raise ValidationError(
                "expected a form (application/x-www-form-urlencoded) of at most "
                f"{MAX_FORM_BYTES} bytes"
            )
        if not self.csrf_verified(request, form.get(CSRF_FIELD)):
            return self.error(
                request, 403, "the form's CSRF token is missing or stale: reload the page"
            )
        return form

    # -- pages ---------------------------------------------------------------------------

    def overview(self, request: Request) -> Response:
        with self.engine.connect().execution_options(
            isolation_level="REPEATABLE READ", postgresql_readonly=True
        ) as conn:
            status = admin.read_status(conn, self.schema, pending=self.pending_count)
            conn.rollback()
        self.sample()
        relayed = chart.per_minute(self.samples.snapshot(), time.time())
        parked = sum(t.parked for t in status.topics)
        pending = sum(t.pending for t in status.topics)
        counted_at = status.pending_counted_at or status.taken_at
        return self.page(
            request,
            "overview.html",
            {
                "status": status,
                "parked": parked,
                "pending": pending,
                # Counted in this page's snapshot, or (a big backlog) earlier, in the background.
                "counted_now": counted_at == status.taken_at,
                "counted_at": counted_at,
                "counted_ago": _age((status.taken_at - counted_at).total_seconds()),
                "age": _age,
                "refresh": REFRESH_SECONDS,
                # Numbers only, drawn by chart.svg_bars: safe to put in the page as markup.
                "chart": Markup(chart.svg_bars(relayed)),
                "relayed_last_hour": sum(v for v in relayed if v is not None),
                "broker": self.settings.bootstrap_servers,
                "group_lags": self.group_lags(),
                "redis": None
                if self.settings.redis_url is None
                else redact_url(self.settings.redis_url),
            },
        )

    def parked(self, request: Request) -> Response:
        params = dict(request.query_params)
        where = data.parse_filter(params)
        offset = data.parse_offset(params.get("offset"))
        with self.engine.connect() as conn:
            rows, total = data.search_parked(conn, self.schema, where, offset)
            conn.rollback()
        query = data.filter_params(where)
        pages = {}
        if offset > 0:
            pages["newer"] = urlencode({**query, "offset": max(0, offset - data.PAGE_SIZE)})
        if offset + data.PAGE_SIZE < total:
            pages["older"] = urlencode({**query, "offset": offset + data.PAGE_SIZE})
        return self.page(
            request,
            "parked.html",
            {
                "rows": rows,
                "total": total,
                "offset": offset,
                "where": query,
                "described": data.describe_filter(where),
                "pages": pages,
            },
        )

    async def parked_action(self, request: Request) -> Response:
        form = await self.admin_form(request)
        if isinstance(form, Response):
            return form
        fields = dict(form)
        action = fields.get("action", "")
        if action not in ("retry", "discard"):
            raise ValidationError(f"unknown action {action[:40]!r}: retry or discard")
        where = data.parse_filter(fields)
        scope = fields.get("scope", "")
        if scope == "selected":
            event_ids: list[Any] | None = data.parse_event_ids(form.getlist("event_id"))
            if not event_ids:
                raise ValidationError("no rows selected: tick the rows to change first")
        elif scope == "matching":
            event_ids = None
        else:
            raise ValidationError(f"unknown scope {scope[:40]!r}: selected or matching")
        confirmed = fields.get("confirmed")
        return await _in_thread(self._change, request, action, scope, where, event_ids, confirmed)

    def _change(
        self,
        request: Request,
        action: str,
        scope: str,
        where: data.ParkedFilter,
        event_ids: list[Any] | None,
        confirmed: str | None,
    ) -> Response:
        described = data.describe_filter(where)
        if event_ids is not None:
            described = f"{len(event_ids)} selected, {described}"
        with self.engine.begin() as conn:
            count = data.count_parked(conn, self.schema, where, event_ids)
            if confirmed != str(count):
                # First step, or the rows changed since the confirmation: (re)state the count.
                conn.rollback()
                return self.page(
                    request,
                    "confirm.html",
                    {
                        "action": action,
                        "scope": scope,
                        "count": count,
                        "described": described,
                        "where": data.filter_params(where),
                        "event_ids": [str(e) for e in event_ids or ()],
                        "changed": confirmed is not None,
                    },
                )
            changed = data.change_parked(conn, self.schema, action, where, event_ids)
        client = request.client.host if request.client else "unknown"
        log.warning("admin %s: %d parked row(s) (%s) from %s", action, changed, described, client)
        done = "put back in line" if action == "retry" else "discarded"
        query = urlencode({**data.filter_params(where), "done": f"{changed} row(s) {done}"})
        return RedirectResponse(f"/parked?{query}", status_code=303)

    def keys(self, request: Request) -> Response:
        lookup = data.parse_key_lookup(dict(request.query_params))
        found = None
        events = data.KeyEvents([], 0)
        if lookup is not None:
            with self.engine.connect() as conn:
                found, events = data.lookup_key(conn, self.schema, *lookup)
                conn.rollback()
        return self.page(
            request,
            "keys.html",
            {
                "lookup": lookup,
                "found": found,
                "events": events,
                "scope": lookup[0] if lookup else "",
                "key": lookup[1] if lookup else "",
            },
        )

    def dead_letters(self, request: Request) -> Response:
        topic = request.query_params.get("topic") or ""
        start = data.parse_dlq_cursor(request.query_params.get("from"))
        dead = admin.DeadLetters(topic, [], 0)
        if topic and self.settings.bootstrap_servers is None:
            raise ValidationError(
                "the dead-letters page reads Kafka: start the console with --bootstrap-servers"
            )
        if topic:
            dead = self._read_dead_letters(self.settings.bootstrap_servers or "", topic, start)
        return self.page(
            request,
            "dlq.html",
            {
                "topic": topic,
                "groups": [data.group_view(g) for g in dead.groups],
                "handled": dead.handled,
                "kafka": self.settings.bootstrap_servers is not None,
                "start": "" if start is None else format_cursor(start),
                "stopped": describe_stop(dead.stopped, dead.limit) if dead.stopped else "",
                "next": format_cursor(dead.stopped) if dead.stopped else "",
            },
        )

    def _read_dead_letters(
        self, bootstrap: str, topic: str, start: dict[int, int] | None
    ) -> admin.DeadLetters:
        """The groups of a page of ``topic`` still to handle (from ``start``)."""
        with self.engine.connect() as conn:
            dead = admin.read_dead_letters(
                conn,
                bootstrap,
                data.check_dlq_topic(topic),
                schema=self.schema,
                kafka_config=self.settings.kafka_config,
                limit=self.settings.dead_letters_limit,
                start=start,
            )
            conn.rollback()
        return dead

    async def redrive_groups(self, request: Request) -> Response:
        return await self._dead_letters_action(request, "redrive")

    async def mark_groups_handled(self, request: Request) -> Response:
        return await self._dead_letters_action(request, "handled")

    async def _dead_letters_action(self, request: Request, action: str) -> Response:
        form = await self.admin_form(request)
        if isinstance(form, Response):
            return form
        topic = data.check_dlq_topic(form.get("topic") or "")
        wanted = data.parse_group_ids(form.getlist("group"))
        start = data.parse_dlq_cursor(form.get("from"))
        if self.settings.bootstrap_servers is None:
            raise ValidationError(
                "start the console with --bootstrap-servers to handle dead letters"
            )
        return await _in_thread(
            self._handle,
            request,
            action,
            topic,
            wanted,
            start,
            form.get("confirmed"),
            self.settings.bootstrap_servers,
        )

    def _handle(
        self,
        request: Request,
        action: str,
        topic: str,
        wanted: list[str],
        start: dict[int, int] | None,
        confirmed: str | None,
        bootstrap: str,
    ) -> Response:
        dead = self._read_dead_letters(bootstrap, topic, start)
        shown = {g.id for g in dead.groups}
        unknown = [g for g in wanted if g not in shown]
        if unknown:
            # Well-formed, but not a group this page holds (handled meanwhile, or never one).
            raise ValidationError(
                f"group {unknown[0]} is not among the dead letters of {topic} still to handle "
                "on this page: it was handled meanwhile or never existed; reload the "
                "dead-letters page"
            )
        letters, _ = choose_letters(dead.groups, wanted, ())
        if confirmed != str(len(letters)):
            # First step, or the dead letters changed since the confirmation: (re)state the count.
            return self.page(
                request,
                "dlq_confirm.html",
                {
                    "action": action,
                    "topic": topic,
                    "wanted": wanted,
                    "start": "" if start is None else format_cursor(start),
                    "count": len(letters),
                    "changed": confirmed is not None,
                },
            )
        client = request.client.host if request.client else "unknown"
        by = f"outbox console from {client}"
        with self.engine.connect() as conn:
            if action == "redrive":
                count = admin.redrive(
                    bootstrap,
                    letters,
                    kafka_config=self.settings.kafka_config,
                    connection=conn,
                    dlq_topic=topic,
                    schema=self.schema,
                    by=by,
                )
                done = f"{count} dead letter(s) redriven"
            else:
                count = admin.discard(conn, topic, letters, self.schema, by=by)
                done = f"{count} dead letter(s) marked handled"
            conn.commit()
        log.warning(
            "admin %s: %d dead letter(s) of %s (groups %s) from %s",
            "redrive" if action == "redrive" else "mark handled",
            count, topic, ", ".join(wanted), client,
        )  # fmt: skip
        params = {"topic": topic, "done": done}
        if start is not None:
            params["from"] = format_cursor(start)
        return RedirectResponse(f"/dlq?{urlencode(params)}", status_code=303)

    def login(self, request: Request) -> Response:
        if self.settings.admin_token is None:
            return self.error(request, 403, "this console is read-only: no admin token was set")
        if not self.is_admin(request):
            return PlainTextResponse(
                "sign in with any user name and the admin token as password\n",
                status_code=401,
                headers={"WWW-Authenticate": 'Basic realm="outbox console", charset="UTF-8"'},
            )
        return RedirectResponse("/", status_code=303)


def _age(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    if seconds < 120:
        return f"{seconds:.0f}s"
    if seconds < 7200:
        return f"{seconds / 60:.0f}m"
    if seconds < 172800:
        return f"{seconds / 3600:.1f}h"
    return f"{seconds / 86400:.1f}d"


async def _in_thread(func: Callable[..., Response], *args: Any) -> Response:
    return await run_in_threadpool(func, *args)


def create_app(settings: ConsoleConfig) -> Starlette:
    """The console as an ASGI app (serve it with uvicorn, or mount it in your own app)."""
    console = Console(settings)

    def guarded(
        handler: Callable[[Request], Response | Awaitable[Response]],
    ) -> Callable[[Request], Awaitable[Response]]:
        async def endpoint(request: Request) -> Response:
            try:
                result = handler(request)
                if isinstance(result, Response):
                    return result
                return await result
            except ValidationError as exc:
                return console.error(request, 400, str(exc))
            except OutboxError as exc:
                return console.error(request, 503, redact_text(str(exc)))
            except sa.exc.DBAPIError as exc:
                console.database_failed(exc)
                return console.error(
                    request, 503, "the database refused or did not answer; see the console's log"
                )

        return endpoint

    def sync(method: Callable[[Request], Response]) -> Callable[[Request], Awaitable[Response]]:
        async def run(request: Request) -> Response:
            return await _in_thread(method, request)

        return run

    async def healthz(_request: Request) -> Response:
        return PlainTextResponse("ok\n")

    routes = [
        Route("/", guarded(sync(console.overview))),
        Route("/parked", guarded(sync(console.parked))),
        Route("/parked/action", guarded(console.parked_action), methods=["POST"]),
        Route("/keys", guarded(sync(console.keys))),
        Route("/dlq", guarded(sync(console.dead_letters))),
        Route("/dlq/redrive", guarded(console.redrive_groups), methods=["POST"]),
        Route("/dlq/handled", guarded(console.mark_groups_handled), methods=["POST"]),
        Route("/login", guarded(console.login)),
        Route("/healthz", healthz),
        Mount("/static", StaticFiles(directory=str(HERE / "static")), name="static"),
    ]

    async def server_error(request: Request, _exc: Exception) -> Response:
        return HTMLResponse(
            "<h1>500</h1><p>internal error; see the console's log</p>", status_code=500
        )

    @contextlib.asynccontextmanager
    async def lifespan(_app: Starlette) -> AsyncIterator[None]:
        await run_in_threadpool(console.start_sampling)
        try:
            yield
        finally:
            console.stop_sampling()
            console.engine.dispose()

    app = Starlette(routes=routes, exception_handlers={500: server_error}, lifespan=lifespan)
    app.state.console = console
    return app
