-- Markers: one row per (handler, message ID) applied. WITHOUT ROWID keeps the
-- table clustered on its primary key, the only index inserts maintain.
CREATE TABLE IF NOT EXISTS {{processed}} (
    handler      TEXT    NOT NULL,
    message_id   TEXT    NOT NULL,
    payload_hash BLOB    NOT NULL,
    processed_at INTEGER NOT NULL, -- Unix microseconds
    PRIMARY KEY (handler, message_id)
) WITHOUT ROWID;
