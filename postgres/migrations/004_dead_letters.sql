-- Dead letters: deliveries that will not succeed by retrying, kept verbatim
-- with the reason until an operator replays or discards them. One row per
-- (handler, message ID); a delivery that failed to decode has no ID and gets
-- a row of its own (keyed by source, payload and error since 007).
CREATE TABLE IF NOT EXISTS {{dead_letters}} (
    id              bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    handler         text COLLATE "C" NOT NULL,
    message_id      text COLLATE "C" NOT NULL DEFAULT '',  -- '' when the delivery did not decode
    envelope        jsonb,                                  -- the message; NULL when it did not decode
    raw             bytea,                                  -- the broker payload as received
    source          text        NOT NULL DEFAULT '',
    error           text        NOT NULL,
    class           text        NOT NULL,                   -- permanent, conflict, decode, exhausted
    fingerprint     text        NOT NULL,                   -- error type + normalised message
    attempts        integer     NOT NULL,
    first_failed_at timestamptz NOT NULL DEFAULT now(),
    last_failed_at  timestamptz NOT NULL DEFAULT now(),
    state           text        NOT NULL DEFAULT 'parked'
        CHECK (state IN ('parked', 'replay_requested', 'replayed', 'discarded'))
);
CREATE UNIQUE INDEX IF NOT EXISTS {{dead_letters_key}} ON {{dead_letters}} (handler, message_id) WHERE message_id <> '';
CREATE INDEX IF NOT EXISTS {{dead_letters_state}} ON {{dead_letters}} (state, handler);

-- Every state change of a dead letter: who asked, when, and the outcome of
-- a replay.
CREATE TABLE IF NOT EXISTS {{dead_letter_log}} (
    id             bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    dead_letter_id bigint      NOT NULL,
    at             timestamptz NOT NULL DEFAULT now(),
    state          text        NOT NULL,
    actor          text        NOT NULL,
    outcome        text        NOT NULL DEFAULT ''
);
CREATE INDEX IF NOT EXISTS {{dead_letter_log_dl}} ON {{dead_letter_log}} (dead_letter_id);
