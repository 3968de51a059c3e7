-- Atomic markers move to a narrow table of their own. The old table keeps
-- the leases and, until retention deletes them, the atomic markers written
-- before this migration; the driver reads both while such rows remain.
--
-- Why: a marker in the old table took 279 bytes (heap and primary key, 1M
-- markers of a 20-byte handler name, UUID IDs, 32-byte hashes). Here it
-- takes about 130:
--   * the handler name is interned to an integer (idem_handlers);
--   * the message ID is a key of bytes: a canonical lowercase UUID string
--     as its 16 bytes, any other ID as its own bytes, a 16-byte one
--     followed by a NUL (IDs hold no NUL, so no two IDs share a key);
--   * the payload hash keeps the first 16 bytes of SHA-256;
--   * no lease columns, and no index but the primary key (retention walks
--     the table in physical order).
--
-- Every statement here is catalog-only or touches new, empty tables. The
-- old table is read once (is any atomic marker left?) and not locked
-- against writers.
CREATE TABLE IF NOT EXISTS {{handlers}} (
    id   integer GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    name text COLLATE "C" NOT NULL UNIQUE
);

CREATE TABLE IF NOT EXISTS {{markers}} (
    handler_id   integer     NOT NULL,
    message_key  bytea       NOT NULL,
    payload_hash bytea       NOT NULL,
    processed_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (handler_id, message_key)
);

-- One row: true while the old table may hold atomic markers (token 0).
-- Retention sets it false once none is left; drivers then stop reading the
-- old table on the atomic path.
CREATE TABLE IF NOT EXISTS {{marker_layout}} (
    legacy_atomic boolean NOT NULL
);
INSERT INTO {{marker_layout}} (legacy_atomic)
SELECT EXISTS (SELECT 1 FROM {{processed}} WHERE token = 0)
WHERE NOT EXISTS (SELECT 1 FROM {{marker_layout}});
