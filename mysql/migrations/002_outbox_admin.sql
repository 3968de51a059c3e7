-- Outbox administration. An operator parks a row the broker refuses (a
-- subject no stream covers): no relay publishes it, nor its key's later
-- rows, until it is retried or discarded. Every retry, park and discard
-- is logged with its actor. MySQL has no ADD COLUMN IF NOT EXISTS: the
-- columns and the index come in one ALTER, and Migrate takes "duplicate
-- column" and "duplicate key name" on a second run as done.
-- parked_at is Unix microseconds; parked_by and park_reason are NULL
-- unless the row is parked.
-- The relay asks, for each candidate row, whether a parked unpublished
-- row of its key comes first: outbox_parked answers from (key, NULL,
-- parked_at > NULL), a range that is empty most of the time.
ALTER TABLE {{outbox}}
    ADD COLUMN parked_at   BIGINT NULL,
    ADD COLUMN parked_by   BLOB   NULL,
    ADD COLUMN park_reason BLOB   NULL,
    ADD KEY {{outbox_parked}} (ordering_key, published_at, parked_at, id);

CREATE TABLE IF NOT EXISTS {{outbox_log}} (
    id           BIGINT         NOT NULL AUTO_INCREMENT PRIMARY KEY,
    outbox_id    BIGINT         NOT NULL,
    message_id   VARBINARY(255) NOT NULL,
    ordering_key VARBINARY(255) NOT NULL,
    destination  VARBINARY(255) NOT NULL,
    action       VARCHAR(8)     NOT NULL CHECK (action IN ('retry', 'park', 'discard')),
    actor        BLOB           NOT NULL,
    reason       BLOB           NOT NULL,
    at           BIGINT         NOT NULL, -- Unix microseconds
    KEY {{outbox_log_at}} (at)
) ENGINE = InnoDB;
