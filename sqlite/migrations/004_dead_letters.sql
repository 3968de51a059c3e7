-- Dead letters: deliveries that will not succeed by retrying, kept verbatim
-- with the reason until an operator replays or discards them. One row per
-- (handler, message ID); a delivery that failed to decode has no ID and gets
-- a row of its own (keyed by source, payload and error since 007).
CREATE TABLE IF NOT EXISTS {{dead_letters}} (
    id              INTEGER PRIMARY KEY AUTOINCREMENT,
    handler         TEXT    NOT NULL,
    message_id      TEXT    NOT NULL DEFAULT '',  -- '' when the delivery did not decode
    envelope        BLOB,                          -- the message as JSON; NULL when it did not decode
    raw             BLOB,                          -- the broker payload as received
    source          TEXT    NOT NULL DEFAULT '',
    error           TEXT    NOT NULL,
    class           TEXT    NOT NULL,              -- permanent, conflict, decode, exhausted
    fingerprint     TEXT    NOT NULL,              -- error type + normalised message: groups alike failures
    attempts        INTEGER NOT NULL,
    first_failed_at INTEGER NOT NULL,              -- Unix microseconds
    last_failed_at  INTEGER NOT NULL,
    state           TEXT    NOT NULL DEFAULT 'parked'
        CHECK (state IN ('parked', 'replay_requested', 'replayed', 'discarded'))
);
CREATE UNIQUE INDEX IF NOT EXISTS {{dead_letters_key}} ON {{dead_letters}} (handler, message_id) WHERE message_id <> '';
CREATE INDEX IF NOT EXISTS {{dead_letters_state}} ON {{dead_letters}} (state, handler);

-- Every state change of a dead letter: who asked, when, and the outcome of
-- a replay.
CREATE TABLE IF NOT EXISTS {{dead_letter_log}} (
    id             INTEGER PRIMARY KEY AUTOINCREMENT,
    dead_letter_id INTEGER NOT NULL,
    at             INTEGER NOT NULL, -- Unix microseconds
    state          TEXT    NOT NULL,
    actor          TEXT    NOT NULL,
    outcome        TEXT    NOT NULL DEFAULT ''
);
CREATE INDEX IF NOT EXISTS {{dead_letter_log_dl}} ON {{dead_letter_log}} (dead_letter_id);
