-- Outbox administration. An operator parks a row the broker refuses (a
-- subject no stream covers): no relay publishes it, nor its key's later
-- rows, until it is retried or discarded. Every retry, park and discard
-- is logged with its actor.
ALTER TABLE {{outbox}} ADD COLUMN parked_at INTEGER; -- Unix microseconds
ALTER TABLE {{outbox}} ADD COLUMN parked_by TEXT NOT NULL DEFAULT '';
ALTER TABLE {{outbox}} ADD COLUMN park_reason TEXT NOT NULL DEFAULT '';
CREATE INDEX IF NOT EXISTS {{outbox_parked}} ON {{outbox}} (ordering_key, id)
    WHERE parked_at IS NOT NULL AND published_at IS NULL;

CREATE TABLE IF NOT EXISTS {{outbox_log}} (
    id           INTEGER PRIMARY KEY,
    outbox_id    INTEGER NOT NULL,
    message_id   TEXT    NOT NULL,
    ordering_key TEXT    NOT NULL,
    destination  TEXT    NOT NULL,
    action       TEXT    NOT NULL CHECK (action IN ('retry', 'park', 'discard')),
    actor        TEXT    NOT NULL,
    reason       TEXT    NOT NULL DEFAULT '',
    at           INTEGER NOT NULL -- Unix microseconds
);
