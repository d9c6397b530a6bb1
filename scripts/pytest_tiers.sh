#!/usr/bin/env bash
# Runs the test suite as two pytest sessions side by side: tests/integration, and every other
# path of pytest's testpaths (unit, e2e, faults, migrations); then the example service's own
# tests as a user runs them, with no database URL set: outbox.testing starts its embedded
# PostgreSQL. Most tests wait on PostgreSQL,
# Redis or the broker, so two sessions on two cores take about half the wall time of one. Each
# session starts its own broker and private servers and names its databases, topics and Redis
# keys apart, so the two never meet.
#
#   scripts/pytest_tiers.sh PYTHON [pytest options...]
#
# Options that name paths or select tests (anything not starting with "-", or -k / -m) run one
# session with them instead. pytest's exit code 5 (no test collected) is a broken suite.
set -uo pipefail
python=$1
shift

single=0
for arg in "$@"; do
    case "$arg" in
        -k|-m|-k*|-m*) single=1 ;;
        -*) ;;
        *) single=1 ;;
    esac
done

judge() {  # judge NAME RC
    if [ "$2" -eq 5 ]; then
        echo "pytest collected no tests in $1: the suite is broken" >&2
    fi
    return "$2"
}

if [ "$single" -eq 1 ]; then
    "$python" -m pytest "$@"
    judge "the selection" $?
    exit $?
fi

logs=$(mktemp -d)
trap 'rm -rf "$logs"' EXIT
echo "running two pytest sessions side by side: tests/integration | the other tiers"
"$python" -m pytest "$@" tests/integration >"$logs/integration" 2>&1 &
integration=$!
"$python" -m pytest "$@" --ignore=tests/integration --ignore=examples/order_service/tests \
    >"$logs/other" 2>&1 &
other=$!

# While both run, a line every OUTBOX_TEST_PROGRESS_EVERY seconds (30): how far each session got
# (pytest's own percentage) and how many tests failed so far, so a long run is never silent.
every=${OUTBOX_TEST_PROGRESS_EVERY:-30}
progress() {  # progress LOG
    local pct failed
    pct=$(grep -o '\[ *[0-9]*%\]' "$1" 2>/dev/null | tail -n1 | tr -d '[] ')
    failed=$(grep -E '\[ *[0-9]+%\]$' "$1" 2>/dev/null |
        sed -E 's/^[^ ]+\.py //; s/ *\[ *[0-9]+%\]$//' | tr -cd 'FE' | wc -c)
    printf '%s%s' "${pct:-starting}" "$([ "$failed" -gt 0 ] && printf ' (%d failed so far)' "$failed")"
}
started=$SECONDS
last=$SECONDS
while kill -0 "$integration" 2>/dev/null || kill -0 "$other" 2>/dev/null; do
    sleep 1
    if [ $((SECONDS - last)) -ge "$every" ]; then
        last=$SECONDS
        elapsed=$((SECONDS - started))
        printf '[%dm%02ds] tests/integration %s | the other tiers %s\n' \
            $((elapsed / 60)) $((elapsed % 60)) "$(progress "$logs/integration")" \
            "$(progress "$logs/other")"
    fi
done
wait "$integration"; rc_integration=$?
wait "$other"; rc_other=$?

echo "=============================== tests/integration ==============================="
cat "$logs/integration"
echo "========================= unit, e2e, faults, migrations ========================="
cat "$logs/other"

echo "============ the example service's tests, on an embedded PostgreSQL ============"
env -u OUTBOX_TESTING_DATABASE_URL -u OUTBOX_DATABASE_URL -u OUTBOX_TEST_DATABASE_URL \
    "$python" -m pytest "$@" -p no:cacheprovider examples/order_service/tests
rc_example=$?

status=0
judge tests/integration "$rc_integration" || status=1
judge "the other tiers" "$rc_other" || status=1
judge "the example service" "$rc_example" || status=1
echo "tests/integration: exit $rc_integration; the other tiers: exit $rc_other;" \
    "the example service: exit $rc_example"
exit "$status"
