-- A dead letter is keyed by (handler, message ID, payload hash): the same
-- message ID failing again with another payload is a second dead letter,
-- so the first payload stays as evidence. Rows written before keep an
-- empty hash; the driver matches them by their raw payload and fills it in.
--
-- A consumer claims a dead letter for its replay by moving it to the new
-- state 'replaying', so that two consumers never run one at once. SQLite
-- cannot change a CHECK in place: the table is rebuilt, its IDs and its
-- AUTOINCREMENT counter kept (the log refers to the IDs; a deleted ID is
-- never handed out again).
CREATE TABLE {{dead_letters_new}} (
    id              INTEGER PRIMARY KEY AUTOINCREMENT,
    handler         TEXT    NOT NULL,
    message_id      TEXT    NOT NULL DEFAULT '',
    payload_hash    TEXT    NOT NULL DEFAULT '',  -- hex SHA-256 of the message payload; '' without a message ID
    envelope        BLOB,
    raw             BLOB,
    source          TEXT    NOT NULL DEFAULT '',
    error           TEXT    NOT NULL,
    class           TEXT    NOT NULL,
    fingerprint     TEXT    NOT NULL,
    attempts        INTEGER NOT NULL,
    first_failed_at INTEGER NOT NULL,
    last_failed_at  INTEGER NOT NULL,
    state           TEXT    NOT NULL DEFAULT 'parked'
        CHECK (state IN ('parked', 'replay_requested', 'replaying', 'replayed', 'discarded'))
);
INSERT INTO {{dead_letters_new}}
    (id, handler, message_id, envelope, raw, source, error, class, fingerprint, attempts, first_failed_at, last_failed_at, state)
SELECT id, handler, message_id, envelope, raw, source, error, class, fingerprint, attempts, first_failed_at, last_failed_at, state
FROM {{dead_letters}};
INSERT INTO sqlite_sequence (name, seq)
SELECT '{{dead_letters_new_name}}', seq FROM sqlite_sequence WHERE name = '{{dead_letters_name}}'
    AND NOT EXISTS (SELECT 1 FROM sqlite_sequence WHERE name = '{{dead_letters_new_name}}');
UPDATE sqlite_sequence SET seq = max(seq, coalesce((SELECT seq FROM sqlite_sequence WHERE name = '{{dead_letters_name}}'), 0))
WHERE name = '{{dead_letters_new_name}}';
DROP TABLE {{dead_letters}};
ALTER TABLE {{dead_letters_new}} RENAME TO {{dead_letters}};
CREATE UNIQUE INDEX {{dead_letters_key}} ON {{dead_letters}} (handler, message_id, payload_hash) WHERE message_id <> '';
CREATE INDEX {{dead_letters_state}} ON {{dead_letters}} (state, handler);
CREATE INDEX {{dead_letters_source}} ON {{dead_letters}} (handler, source) WHERE message_id = '';
