"""``python -m outbox.cli`` runs the ``outbox`` command."""

import sys

from outbox.cli import main

sys.exit(main())
