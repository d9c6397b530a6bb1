"""``outbox console``: a web console for the people on call (docs/console.md).

Invariant: ``import outbox`` never loads the web stack (Starlette, Jinja2, uvicorn, from the
``outbox-kit[console]`` extra); only :mod:`outbox.console.app` and the modules it is built
from (``access``, ``pages``) import it, and nothing imports those but the app.
"""
