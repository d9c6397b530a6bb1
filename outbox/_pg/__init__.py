"""The PostgreSQL adapter: statements, transactions, driver errors, locks and wake-ups.

Invariant: the only home of SQL text and of psycopg; services call it and never import the
driver.
"""
