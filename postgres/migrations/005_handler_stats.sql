-- Delivery counters per handler for the outcomes that leave no row of their
-- own: duplicates and stale deliveries. idem.StatsRecorder adds to them.
CREATE TABLE IF NOT EXISTS {{handler_stats}} (
    handler    text COLLATE "C" PRIMARY KEY,
    duplicates bigint      NOT NULL DEFAULT 0,
    stale      bigint      NOT NULL DEFAULT 0,
    updated_at timestamptz NOT NULL DEFAULT now()
);
