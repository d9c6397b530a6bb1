"""The Redis adapter: the outcome cache and the guard's scripts.

Invariant: no other part of the package imports ``redis``.
"""
