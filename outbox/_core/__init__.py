"""Pure decisions, standard library only: no I/O, no driver imports.

Everything here is shared by the sync and asyncio flavours and by every service; each decision
is written once and unit-tested without services.
"""
