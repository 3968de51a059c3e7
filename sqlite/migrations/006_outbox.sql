-- Transactional outbox: rows added in the business transaction, published
-- by a relay, marked published after the broker acknowledged them.
CREATE TABLE IF NOT EXISTS {{outbox}} (
    id           INTEGER PRIMARY KEY,
    destination  TEXT    NOT NULL,
    message_id   TEXT    NOT NULL,
    ordering_key TEXT    NOT NULL,
    aggregate_id TEXT    NOT NULL DEFAULT '',
    seq          INTEGER NOT NULL DEFAULT 0,
    type         TEXT    NOT NULL DEFAULT '',
    headers      BLOB,
    payload      BLOB    NOT NULL,
    payload_hash BLOB    NOT NULL,
    created_at   INTEGER NOT NULL, -- Unix microseconds
    published_at INTEGER,          -- Unix microseconds
    attempts     INTEGER NOT NULL DEFAULT 0,
    last_error   TEXT    NOT NULL DEFAULT ''
);
CREATE INDEX IF NOT EXISTS {{outbox_pending}} ON {{outbox}} (ordering_key, id) WHERE published_at IS NULL;
CREATE INDEX IF NOT EXISTS {{outbox_pending_id}} ON {{outbox}} (id) WHERE published_at IS NULL;

-- Relays' claims on ordering keys: one live owner per key.
CREATE TABLE IF NOT EXISTS {{outbox_claims}} (
    ordering_key  TEXT    NOT NULL PRIMARY KEY,
    owner         TEXT    NOT NULL,
    claimed_until INTEGER NOT NULL -- Unix microseconds
) WITHOUT ROWID;
