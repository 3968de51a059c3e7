-- Transactional outbox: rows added in the business transaction, published
-- by a relay, marked published after the broker acknowledged them.
CREATE TABLE IF NOT EXISTS {{outbox}} (
    id           bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    destination  text        NOT NULL,
    message_id   text        NOT NULL,
    ordering_key text COLLATE "C" NOT NULL,
    aggregate_id text        NOT NULL DEFAULT '',
    seq          bigint      NOT NULL DEFAULT 0,
    type         text        NOT NULL DEFAULT '',
    headers      bytea,
    payload      bytea       NOT NULL,
    payload_hash bytea       NOT NULL,
    created_at   timestamptz NOT NULL DEFAULT now(),
    published_at timestamptz,
    attempts     integer     NOT NULL DEFAULT 0,
    last_error   text        NOT NULL DEFAULT ''
);
-- The relay's queue: pending rows only, so it stays small.
CREATE INDEX IF NOT EXISTS {{outbox_pending}} ON {{outbox}} (ordering_key, id) WHERE published_at IS NULL;
CREATE INDEX IF NOT EXISTS {{outbox_pending_id}} ON {{outbox}} (id) WHERE published_at IS NULL;

-- Relays' claims on ordering keys: one live owner per key.
CREATE TABLE IF NOT EXISTS {{outbox_claims}} (
    ordering_key  text COLLATE "C" PRIMARY KEY,
    owner         text        NOT NULL,
    claimed_until timestamptz NOT NULL
);

-- Wake listening relays when rows commit (one notification per statement,
-- coalesced per transaction by Postgres).
CREATE OR REPLACE FUNCTION {{outbox_notify_fn}}() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_notify('{{outbox_channel}}', '');
    RETURN NULL;
END $$;
DROP TRIGGER IF EXISTS {{outbox_notify}} ON {{outbox}};
CREATE TRIGGER {{outbox_notify}} AFTER INSERT ON {{outbox}} FOR EACH STATEMENT EXECUTE FUNCTION {{outbox_notify_fn}}();
