#!/usr/bin/env bash
# From a fresh clone to a running demo: the virtualenv, the dependencies, local PostgreSQL and
# Redis when they are installed but not answering (and no URL names other ones), then the demo,
# which starts embedded servers (the dev extra's wheels) for what is not installed at all.
#
#   bash scripts/bootstrap.sh demo [--quick] [demo options]   # what `make demo` runs
#   bash scripts/bootstrap.sh services                         # only PostgreSQL and Redis
#   bash scripts/bootstrap.sh venv                             # only the virtualenv
set -euo pipefail
cd "$(dirname "$0")/.."

VENV=${VENV:-.venv}
PYTHON="$VENV/bin/python"

say() { printf '==> %s\n' "$*"; }

# Where an installed PostgreSQL is looked for (HOST:PORT), as scripts/demo.py does.
PG_ADDRESS=${OUTBOX_DEMO_LOCAL_POSTGRES:-127.0.0.1:5432}
PG_HOST=${PG_ADDRESS%:*}
PG_PORT=${PG_ADDRESS##*:}

with_progress() {  # with_progress WHAT COMMAND...: a line every 10 s while COMMAND runs
    local what=$1 started=$SECONDS pid rc
    shift
    "$@" &
    pid=$!
    while kill -0 "$pid" 2>/dev/null; do
        for _ in 1 2 3 4 5 6 7 8 9 10; do
            kill -0 "$pid" 2>/dev/null || break
            sleep 1
        done
        if kill -0 "$pid" 2>/dev/null; then
            printf '    ... %s (%ds)\n' "$what" $((SECONDS - started))
        fi
    done
    wait "$pid"; rc=$?
    return "$rc"
}

ensure_venv() {
    if [ ! -x "$PYTHON" ]; then
        say "creating $VENV"
        python3 -m venv "$VENV"
    fi
    # Same marker as `make venv`: reinstall when pyproject.toml changed.
    if [ ! -f "$VENV/.installed" ] || [ pyproject.toml -nt "$VENV/.installed" ]; then
        say "installing outbox-kit and its dev extra (includes the Tansu broker; about a minute)"
        with_progress "upgrading pip" \
            "$PYTHON" -m pip install --quiet --disable-pip-version-check --upgrade pip
        with_progress "installing the dependencies" \
            "$PYTHON" -m pip install --quiet --disable-pip-version-check -e '.[dev]'
        touch "$VENV/.installed"
    fi
}

wait_until() {  # wait_until SECONDS COMMAND...
    local deadline=$((SECONDS + $1)); shift
    until "$@" >/dev/null 2>&1; do
        if [ "$SECONDS" -ge "$deadline" ]; then return 1; fi
        sleep 0.5
    done
}

not_started() {  # not_started WHAT: the demo falls back to its embedded server, others stop
    if [ "$command" = demo ]; then
        say "$1: the installed server did not start; the demo starts an embedded one"
    else
        echo "$1 did not start" >&2
        exit 1
    fi
}

ensure_postgres() {
    if [ -n "${OUTBOX_DATABASE_URL:-}" ]; then
        say "PostgreSQL: using OUTBOX_DATABASE_URL"
        return
    fi
    if pg_isready -q -h "$PG_HOST" -p "$PG_PORT" 2>/dev/null; then
        return
    fi
    if ! command -v pg_ctlcluster >/dev/null 2>&1 || [ ! -d /etc/postgresql ]; then
        # Nothing installed: the demo starts the embedded PostgreSQL of the dev extra.
        say "PostgreSQL: none installed here; the demo starts an embedded one"
        return
    fi
    say "starting PostgreSQL"
    # An installed cluster that cannot be started (a stale pid file, another data folder
    # running, no permission) is no reason to stop: the demo has an embedded one.
    if ! pg_ctlcluster --skip-systemctl-redirect "$(ls /etc/postgresql | head -n1)" main start \
            || ! wait_until 60 pg_isready -q -h "$PG_HOST" -p "$PG_PORT"; then
        not_started PostgreSQL
    fi
}

ensure_redis() {
    if [ -n "${OUTBOX_REDIS_URL:-}" ]; then
        say "Redis: using OUTBOX_REDIS_URL"
        return
    fi
    if redis-cli -h 127.0.0.1 -p 6379 ping >/dev/null 2>&1; then
        return
    fi
    if ! command -v redis-server >/dev/null 2>&1; then
        say "Redis: none installed here; the demo starts an embedded one"
        return
    fi
    say "starting Redis"
    if ! { mkdir -p /var/lib/redis /var/log/redis &&
            redis-server --daemonize yes --bind 127.0.0.1 -::1 --port 6379 --save "" \
                --appendonly no --dir /var/lib/redis --logfile /var/log/redis/ci.log; } \
            || ! wait_until 30 redis-cli -h 127.0.0.1 -p 6379 ping; then
        not_started Redis
    fi
}

command=${1:-demo}
shift || true
case "$command" in
    venv) ensure_venv ;;
    services) ensure_postgres; ensure_redis ;;
    demo)
        ensure_venv
        ensure_postgres
        ensure_redis
        exec "$PYTHON" scripts/demo.py "$@"
        ;;
    *) echo "usage: $0 [demo|services|venv] [demo options]" >&2; exit 2 ;;
esac
