-- The privileges outbox-relay needs, granted to the group role outbox_relay (NOLOGIN); give it
-- to the relay's login role with `GRANT outbox_relay TO billing_relay`.
--
-- Run it as the tables' owner, in the database and with the search_path the application uses,
-- after `outbox migrate` (it grants on the toolkit's tables in current_schema()):
--
--   PGOPTIONS='-c search_path=billing' psql "$DATABASE_URL" -f deploy/sql/relay-role.sql
--
-- What each grant is for (docs/relay.md, "Privileges"):
--   CONNECT on the database, USAGE on the schema   reach the tables
--   SELECT, UPDATE, DELETE on outbox              claim (SELECT ... FOR UPDATE), record failures
--                                                 and park rows, delete the rows sent
--   SELECT on the outbox's id sequence            read its last value for the low-water mark;
--                                                 without it the relay still delivers, claiming
--                                                 from the table's low end (it logs
--                                                 event=low_water_off reason=privilege)
--   SELECT on outbox_alembic_version              `outbox-relay --check` reads the revision
-- No INSERT, no nextval (USAGE on the sequence), nothing on idempotency_keys. Lanes are
-- advisory locks and wake-ups LISTEN, which need no grant.

DO $$
BEGIN
    CREATE ROLE outbox_relay NOLOGIN;
EXCEPTION WHEN duplicate_object OR unique_violation THEN
    NULL;  -- there already (roles belong to the whole cluster)
END
$$;

DO $$
DECLARE
    schema_name text := current_schema();
BEGIN
    EXECUTE format('GRANT CONNECT ON DATABASE %I TO outbox_relay', current_database());
    EXECUTE format('GRANT USAGE ON SCHEMA %I TO outbox_relay', schema_name);
    EXECUTE format('GRANT SELECT, UPDATE, DELETE ON %I.outbox TO outbox_relay', schema_name);
    EXECUTE format('GRANT SELECT ON %I.outbox_alembic_version TO outbox_relay', schema_name);
    -- The window engine (outbox-relay --engine window): its cursors and held keys, and the
    -- TRUNCATE that gives the delivered rows' space back (without it, a bulk DELETE does).
    IF to_regclass(format('%I.outbox_relay_windows', schema_name)) IS NOT NULL THEN
        EXECUTE format('GRANT TRUNCATE ON %I.outbox TO outbox_relay', schema_name);
        EXECUTE format(
            'GRANT SELECT, INSERT, UPDATE, DELETE ON %I.outbox_relay_windows, '
            '%I.outbox_relay_held TO outbox_relay', schema_name, schema_name
        );
    END IF;
    EXECUTE format(
        'GRANT SELECT ON SEQUENCE %s TO outbox_relay',
        pg_get_serial_sequence(format('%I.outbox', schema_name), 'id')
    );
END
$$;
