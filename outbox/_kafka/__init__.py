"""The Kafka adapter: the only importer of ``confluent_kafka`` (producers, consumer settings,
dead letters)."""
