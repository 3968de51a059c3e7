-- Markers: one row per (handler, message ID) applied. The primary key is the
-- guarantee: a concurrent insert of the same key waits on it. Handler names
-- and message IDs are opaque byte strings: COLLATE "C" compares them with
-- memcmp (cheaper than a locale, and the byte order the processor sorts a
-- batch's IDs in, so concurrent batches lock in index order).
CREATE TABLE IF NOT EXISTS {{processed}} (
    handler      text COLLATE "C" NOT NULL,
    message_id   text COLLATE "C" NOT NULL,
    payload_hash bytea       NOT NULL,
    processed_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (handler, message_id)
);

-- Retention deletes by age. Markers arrive in time order, so a BRIN index is
-- tiny and nearly free to maintain (a btree here cost ~20% of batched
-- throughput).
CREATE INDEX IF NOT EXISTS {{processed_at_idx}} ON {{processed}} USING brin (processed_at);
