"""``python -m tests.apps.serve_raw {werkzeug|wsgiref} PORT``: ``tests/apps/http_raw_wsgi.py``
under Werkzeug's development server (what ``flask run`` uses) or the standard library's
wsgiref, on 127.0.0.1."""

from __future__ import annotations

import sys
from wsgiref.simple_server import WSGIRequestHandler, make_server


class _Quiet(WSGIRequestHandler):
    def log_message(self, format: str, *args: object) -> None:
        return None


def main() -> None:
    server, port = sys.argv[1], int(sys.argv[2])
    from tests.apps.http_raw_wsgi import app

    if server == "werkzeug":
        from werkzeug.serving import run_simple

        run_simple("127.0.0.1", port, app, threaded=True)
    else:
        make_server("127.0.0.1", port, app, handler_class=_Quiet).serve_forever()


if __name__ == "__main__":
    main()
