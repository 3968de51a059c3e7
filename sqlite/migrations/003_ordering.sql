-- Ordering guard: the last applied sequence per (handler, aggregate).
CREATE TABLE IF NOT EXISTS {{sequences}} (
    handler      TEXT    NOT NULL,
    aggregate_id TEXT    NOT NULL,
    last_seq     INTEGER NOT NULL,
    PRIMARY KEY (handler, aggregate_id)
) WITHOUT ROWID;

-- First sighting of a sequence that arrived after a gap (Wait policy).
CREATE TABLE IF NOT EXISTS {{gaps}} (
    handler       TEXT    NOT NULL,
    aggregate_id  TEXT    NOT NULL,
    seq           INTEGER NOT NULL,
    first_seen_at INTEGER NOT NULL, -- Unix microseconds
    PRIMARY KEY (handler, aggregate_id, seq)
) WITHOUT ROWID;

-- Write side: the version of each aggregate.
CREATE TABLE IF NOT EXISTS {{versions}} (
    stream       TEXT    NOT NULL,
    aggregate_id TEXT    NOT NULL,
    version      INTEGER NOT NULL,
    PRIMARY KEY (stream, aggregate_id)
) WITHOUT ROWID;
