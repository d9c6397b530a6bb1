"""The Kafka adapter: producers, consumer settings, dead letters.

Invariant: no other part of the package imports ``confluent_kafka``.
"""
