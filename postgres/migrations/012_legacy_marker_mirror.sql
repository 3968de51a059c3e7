-- A process still running an idem from before migration 011 writes its
-- atomic markers to the old table only, and reads only the old table. In a
-- rolling deploy, old and new processes share the stream for a while: a
-- message applied by a new process (its marker in the new table) and
-- redelivered to an old one would be applied again.
--
-- This trigger closes that window. Every atomic marker an old process
-- inserts (token 0) is written to the new table too, in the same
-- transaction. If the new table already holds the key, the message was
-- applied under the new layout: the old process's transaction fails, and
-- its delivery is retried until a new process takes it (a Duplicate). Two
-- processes holding the same key at once wait on the new table's primary
-- key, as two new ones do. Leases (token > 0) are not mirrored: lease mode
-- keeps the old table.
CREATE OR REPLACE FUNCTION {{mirror_fn}}() RETURNS trigger LANGUAGE plpgsql AS $fn$
DECLARE
    hid integer;
    k   bytea;
BEGIN
    INSERT INTO {{handlers}} (name) VALUES (NEW.handler) ON CONFLICT (name) DO NOTHING;
    SELECT id INTO hid FROM {{handlers}} WHERE name = NEW.handler;
    IF NEW.message_id ~ '^[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$' THEN
        k := decode(replace(NEW.message_id, '-', ''), 'hex');
    ELSIF octet_length(NEW.message_id) = 16 THEN
        k := convert_to(NEW.message_id, 'UTF8') || decode('00', 'hex');
    ELSE
        k := convert_to(NEW.message_id, 'UTF8');
    END IF;
    INSERT INTO {{markers}} (handler_id, message_key, payload_hash, processed_at)
    VALUES (hid, k, substring(NEW.payload_hash FROM 1 FOR 16), NEW.processed_at)
    ON CONFLICT DO NOTHING;
    IF NOT FOUND THEN
        RAISE EXCEPTION 'idem: handler %, message %: applied already under the marker layout of migration 011; this process runs an older idem: upgrade it', NEW.handler, NEW.message_id
            USING ERRCODE = 'P0001';
    END IF;
    RETURN NULL;
END
$fn$;

DROP TRIGGER IF EXISTS {{mirror_trigger}} ON {{processed}};
CREATE TRIGGER {{mirror_trigger}} AFTER INSERT ON {{processed}}
    FOR EACH ROW WHEN (NEW.token = 0) EXECUTE FUNCTION {{mirror_fn}}();
