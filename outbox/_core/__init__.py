"""Pure decisions, standard library only: no I/O, no driver imports.

Invariant: each decision is written once, shared by the sync and asyncio flavours and by every
service, and unit-tested without services.
"""
