"""The Redis adapter: the only importer of ``redis`` (the outcome cache, the guard's scripts)."""
