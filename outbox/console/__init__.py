"""``outbox console``: a web console for the people on call (docs/console.md).

Server-rendered pages over the outbox tables: the backlog and the live relays, the parked rows
(search, look inside, retry or discard), and idempotency keys. Read-only unless started with an
admin token and the request carries it. The web stack (Starlette, Jinja2, uvicorn) comes with
the optional ``outbox-kit[console]`` extra: this package's :mod:`outbox.console.app` imports it,
``import outbox`` never does.
"""
