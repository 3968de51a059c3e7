-- Delivery counters per handler for the outcomes that leave no row of their
-- own: duplicates and stale deliveries. idem.StatsRecorder adds to them.
CREATE TABLE IF NOT EXISTS {{handler_stats}} (
    handler    TEXT    NOT NULL PRIMARY KEY,
    duplicates INTEGER NOT NULL DEFAULT 0,
    stale      INTEGER NOT NULL DEFAULT 0,
    updated_at INTEGER NOT NULL -- Unix microseconds
) WITHOUT ROWID;
