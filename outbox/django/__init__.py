"""The Django door (extra ``django``): units of work on Django's own connection.

Add ``"outbox.django"`` to ``INSTALLED_APPS``; ``manage.py migrate`` creates the toolkit's
tables (the alembic history, see ``migrations/0001_initial.py``). ``unit_of_work(key)`` runs
inside the transaction Django commits; ``idempotent`` is its decorator form. See
``docs/django.md``.
"""

from __future__ import annotations

from outbox.django._unit import idempotent, unit_of_work

__all__ = ["idempotent", "unit_of_work"]
