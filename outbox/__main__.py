"""``python -m outbox`` runs the ``outbox`` command."""

import sys

from outbox.cli import main

sys.exit(main())
