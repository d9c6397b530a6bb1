"""``outbox-relay``: carry committed outbox rows to Kafka."""

import sys

from outbox.relay import main

__all__ = ["main"]

if __name__ == "__main__":
    sys.exit(main())
