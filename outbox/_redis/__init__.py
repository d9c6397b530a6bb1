"""The Redis adapters: the only modules that import redis."""
