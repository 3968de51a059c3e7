-- Outbox administration. An operator parks a row the broker refuses (a
-- subject no stream covers): no relay publishes it, nor its key's later
-- rows, until it is retried or discarded. Every retry, park and discard
-- is logged with its actor. Adding nullable and constant-default columns
-- rewrites nothing.
ALTER TABLE {{outbox}}
    ADD COLUMN IF NOT EXISTS parked_at   timestamptz,
    ADD COLUMN IF NOT EXISTS parked_by   text NOT NULL DEFAULT '',
    ADD COLUMN IF NOT EXISTS park_reason text NOT NULL DEFAULT '';
-- The relay asks, for each candidate row, whether a parked row of its key
-- comes first: an index of the parked rows alone, empty most of the time.
CREATE INDEX IF NOT EXISTS {{outbox_parked}} ON {{outbox}} (ordering_key, id)
    WHERE parked_at IS NOT NULL AND published_at IS NULL;

CREATE TABLE IF NOT EXISTS {{outbox_log}} (
    id           bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    outbox_id    bigint      NOT NULL,
    message_id   text        NOT NULL,
    ordering_key text        NOT NULL,
    destination  text        NOT NULL,
    action       text        NOT NULL CHECK (action IN ('retry', 'park', 'discard')),
    actor        text        NOT NULL,
    reason       text        NOT NULL DEFAULT '',
    at           timestamptz NOT NULL DEFAULT now()
);
