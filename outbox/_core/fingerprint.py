"""The consumer's request fingerprints: what a message that reuses a stored key must match.

A message's key comes from its producer, and any producer of any topic a consumer group reads
could send a key that another topic's message will carry. Without a fingerprint the later
message is taken for a duplicate and dropped. With the default one, :func:`topic_fingerprint`
(SHA-256 over the topic), the same key on another topic is a ``key-reuse`` dead letter instead;
on the same topic it is still a duplicate, whatever its bytes (a producer may re-send a message
re-serialized, with a new timestamp). :func:`message_fingerprint` also covers the value, for
producers whose re-sends are byte for byte.

Keys stored without a fingerprint (by earlier versions) match any fingerprint: upgrading does
not turn redeliveries into dead letters.
"""

from __future__ import annotations

import functools
import hashlib
from typing import Any

_PERSON = b"outbox-record-v1\x00"


def record_fingerprint(topic: str, value: bytes | None = None, *, with_value: bool = True) -> str:
    """``sha256:<hex>`` over ``topic`` and (``with_value``) ``value``, each length-prefixed; a
    tombstone's ``None`` is not ``b""``."""
    name = topic.encode("utf-8", "surrogatepass")
    digest = hashlib.sha256(_PERSON + b"%d:" % len(name) + name)
    if not with_value:
        digest.update(b"*")
    elif value is None:
        digest.update(b"-")
    else:
        digest.update(b"%d:" % len(value))
        digest.update(value)
    return "sha256:" + digest.hexdigest()


def topic_fingerprint(message: Any) -> str:
    """The default ``fingerprint_func`` of the consumer runners: the message's topic."""
    return _of_topic(message.topic() or "")


@functools.lru_cache(maxsize=1024)
def _of_topic(topic: str) -> str:
    """A topic's fingerprint, hashed once per topic rather than once per message."""
    return record_fingerprint(topic, with_value=False)


def message_fingerprint(message: Any) -> str:
    """A ``fingerprint_func`` over the message's topic and value: a key reused with other
    bytes is a ``key-reuse`` dead letter too."""
    value = message.value()
    return record_fingerprint(message.topic() or "", None if value is None else bytes(value))
