"""Three `outbox consume --guard-redis-url` processes in one group, SIGKILLed and restarted.

No PostgreSQL: the handlers' effects go to a Redis list of their own (one entry per run of a
handler, with its key, fence and process), the guard's records to a private redis-server.
Messages: 20% duplicates of earlier keys (on other partitions, so duplicates race their
originals across processes), some poison (PermanentError) and some without a key.

What a lease-based guard can promise is checked, and no more: every good key ran, duplicates
never ran twice -- except for a message whose handler a SIGKILL cut off after its effect but
before its outcome was stored. That key runs again once its lease ran out (a guarded consumer
handles one message at a time, so a kill cuts off at most one), and always with a higher fence:
never two owners at once. Every offset is committed at the end, the dead-letter topic holds the
poison keys and the key-less messages, and every poison key is recorded as failed.
"""

from __future__ import annotations

import json
import os
import random
import sys
import uuid
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import redis

from outbox import PermanentError
from outbox.errors import PreviouslyFailed
from outbox.guard import RedisGuard
from tests.faults.test_consumer_kill import (  # noqa: F401 -- fleet is a fixture
    PARTITIONS,
    Fleet,
    build_messages,
    check_dead_letters,
    committed,
    fleet,
    produce,
)
from tests.fixtures.common import wait_for
from tests.fixtures.consumer import KAFKA
from tests.fixtures.kafka import create_topic
from tests.fixtures.redis import PrivateRedis

TOTAL = 2000
DUPLICATES = TOTAL // 5
POISON = 20
KEYLESS = 10
GOOD = TOTAL - DUPLICATES - POISON - KEYLESS
PROCESSES = 3
LEASE = 2.0
OUTBOX_BIN = str(Path(sys.executable).with_name("outbox"))
EFFECTS_URL = "GUARD_EFFECTS_REDIS_URL"
EFFECTS_KEY = "guarded-effects"

_client: redis.Redis | None = None


def _effects() -> redis.Redis:
    global _client
    if _client is None:
        _client = redis.Redis.from_url(os.environ[EFFECTS_URL], socket_timeout=5)
    return _client


def handle(claim: Any, message: Any) -> dict[str, int]:
    """The consumers' handler (imported by `outbox consume` as a module:function): its effect
    is an entry in a Redis list, outside PostgreSQL and outside the guard."""
    body = json.loads(message.value())
    if body["poison"]:
        raise PermanentError(f"message {body['n']} cannot be applied")
    _effects().rpush(EFFECTS_KEY, f"{claim.key}|{claim.fence}|{os.getpid()}")
    return {"n": body["n"]}


async def handle_async(claim: Any, message: Any) -> dict[str, int]:
    """The same handler for the asyncio runner."""
    return handle(claim, message)


@pytest.mark.slow
@pytest.mark.parametrize("handler", ["handle", "handle_async"], ids=["sync", "asyncio"])
def test_kill_restart_three_guarded_consumers(
    handler: str,
    kafka_bootstrap: str,
    private_redis: Callable[..., PrivateRedis],
    fleet: Callable[[list[str]], Fleet],  # noqa: F811 -- the fixture imported above
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    rng = random.Random(14)
    topic = f"guard-kill-{uuid.uuid4().hex[:10]}"
    group = f"mailer-{uuid.uuid4().hex[:8]}"
    create_topic(kafka_bootstrap, topic, partitions=PARTITIONS)
    create_topic(kafka_bootstrap, topic + ".dlq", partitions=1)
    guard_redis, effects_redis = private_redis(), private_redis()
    monkeypatch.setenv(EFFECTS_URL, effects_redis.url)  # the consumers inherit it

    messages = build_messages(rng, GOOD, POISON, KEYLESS, DUPLICATES)
    first, rest = messages[: TOTAL // 2], messages[TOTAL // 2 :]
    per_partition = produce(kafka_bootstrap, topic, first)

    command = [
        OUTBOX_BIN, "consume", f"{__name__}:{handler}", "--topic", topic, "--group", group,
        "--guard-redis-url", guard_redis.url, "--guard-lease", str(LEASE),
        "--bootstrap-servers", kafka_bootstrap, "--log-level", "WARNING",
    ]  # fmt: skip
    for name, value in KAFKA.items():
        command += ["--kafka-config", f"{name}={value}"]
    consumers = fleet(command)
    for slot in range(PROCESSES):
        consumers.start(slot)
    more = produce(kafka_bootstrap, topic, rest)
    per_partition = [a + b for a, b in zip(per_partition, more, strict=True)]

    client = redis.Redis.from_url(effects_redis.url, socket_timeout=5)
    try:
        # Kill while work is in flight, restart at once; twice, hitting different processes.
        for threshold, victims in ((GOOD // 5, [0]), (GOOD // 2, [1, 2])):
            wait_for(
                lambda t=threshold: int(client.llen(EFFECTS_KEY)) >= t, 120,
                f"{threshold} effects before a kill\n{consumers.logs()}", interval=0.02,
            )  # fmt: skip
            for slot in victims:
                consumers.kill(slot)
                consumers.start(slot)

        wait_for(
            lambda: committed(kafka_bootstrap, group, topic) == per_partition,
            180, f"every offset committed (want {per_partition})\n{consumers.logs()}",
            interval=0.2,
        )  # fmt: skip
        codes = consumers.terminate_all()
        assert codes == [0] * PROCESSES, consumers.logs()
        entries = [e.decode().split("|") for e in client.lrange(EFFECTS_KEY, 0, -1)]
    finally:
        client.close()

    runs: dict[str, list[int]] = defaultdict(list)
    for key, fence, _pid in entries:
        runs[key].append(int(fence))
    # Every good key ran; nothing else did.
    assert set(runs) == {f"good-{i}" for i in range(GOOD)}
    # A key ran again only after a kill cut its handler off (at most one per kill), and each
    # later run held a higher fence: taken over after the lease, never two owners at once.
    again = {key: fences for key, fences in runs.items() if len(fences) > 1}
    assert len(again) <= consumers.kills, again
    for fences in again.values():
        assert fences == sorted(set(fences)), fences
    assert sum(len(f) - 1 for f in again.values()) <= consumers.kills

    # The dead-letter topic holds the poison keys and the key-less messages, nothing else; a
    # copy needs a kill between a dead letter's confirmation and what follows it (the failure
    # record, the offset commit), or a poison duplicate redelivered after such a kill.
    letters = check_dead_letters(kafka_bootstrap, topic, GOOD, POISON, KEYLESS)
    duplicated_poison = {m["key"] for m in messages if m["poison"] and m["n"] == -1}
    assert letters - (POISON + KEYLESS) <= consumers.kills + len(duplicated_poison)

    # Every poison key is recorded as failed in the guard, in the consumers' scope (the group).
    guard = RedisGuard(guard_redis.url)
    try:
        for i in range(POISON):
            with pytest.raises(PreviouslyFailed), guard.claim(f"poison-{i}", scope=group):
                pass
    finally:
        guard.close()
