"""The PostgreSQL adapter: the only home of SQL text and of psycopg.

Statements (entity-first names), the unit of work's transaction, the translation of driver
errors, lane locks and the relays' wake-up live here; services above call them and never import
the driver.
"""
