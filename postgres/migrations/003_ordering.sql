-- Ordering guard: the last applied sequence per (handler, aggregate).
CREATE TABLE IF NOT EXISTS {{sequences}} (
    handler      text   NOT NULL,
    aggregate_id text   NOT NULL,
    last_seq     bigint NOT NULL,
    PRIMARY KEY (handler, aggregate_id)
);

-- First sighting of a sequence that arrived after a gap, so the Wait
-- policy's deadline survives retries, restarts and other instances.
CREATE TABLE IF NOT EXISTS {{gaps}} (
    handler       text        NOT NULL,
    aggregate_id  text        NOT NULL,
    seq           bigint      NOT NULL,
    first_seen_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (handler, aggregate_id, seq)
);

-- Write side: the version of each aggregate, for the sequence allocator and
-- optimistic concurrency.
CREATE TABLE IF NOT EXISTS {{versions}} (
    stream       text   NOT NULL,
    aggregate_id text   NOT NULL,
    version      bigint NOT NULL,
    PRIMARY KEY (stream, aggregate_id)
);
