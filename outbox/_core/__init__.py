"""Pure decisions: no I/O, standard library only, shared by the sync and asyncio services."""
