-- idem's schema on MySQL / MariaDB (InnoDB). Every key column is VARBINARY:
-- IDs are compared byte for byte, so case and trailing spaces count, and no
-- collation (PAD SPACE or otherwise) can merge two IDs. Times are Unix
-- microseconds of the server's clock (UTC_TIMESTAMP), so every host agrees.

-- Handler names, interned to the small integer atomic markers are keyed by.
CREATE TABLE IF NOT EXISTS {{handlers}} (
    id   INT            NOT NULL AUTO_INCREMENT PRIMARY KEY,
    name VARBINARY(128) NOT NULL,
    UNIQUE KEY {{handlers_name}} (name)
) ENGINE = InnoDB;

-- Atomic markers: one row per (handler, message ID) applied, written in the
-- handler's transaction. The payload hash keeps the first 16 bytes of
-- SHA-256 (empty for imported markers).
CREATE TABLE IF NOT EXISTS {{markers}} (
    handler_id   INT            NOT NULL,
    message_id   VARBINARY(255) NOT NULL,
    payload_hash VARBINARY(32)  NOT NULL,
    processed_at BIGINT         NOT NULL,
    PRIMARY KEY (handler_id, message_id)
) ENGINE = InnoDB;

-- Lease mode: one row per (handler, message ID) with its lease, fencing
-- token and attempts.
CREATE TABLE IF NOT EXISTS {{leases}} (
    handler         VARBINARY(128) NOT NULL,
    message_id      VARBINARY(255) NOT NULL,
    payload_hash    VARBINARY(32)  NOT NULL,
    processed_at    BIGINT         NOT NULL,
    status          VARCHAR(8)     NOT NULL, -- running, done, failed
    owner           BLOB           NULL,
    lease_until     BIGINT         NULL,
    token           BIGINT         NOT NULL,
    attempts        INT            NOT NULL,
    next_attempt_at BIGINT         NULL,     -- NULL on a failed row: never
    last_error      BLOB           NULL,
    PRIMARY KEY (handler, message_id)
) ENGINE = InnoDB;

-- Ordering guard: the last applied sequence per (handler, aggregate).
CREATE TABLE IF NOT EXISTS {{sequences}} (
    handler      VARBINARY(128) NOT NULL,
    aggregate_id VARBINARY(255) NOT NULL,
    last_seq     BIGINT         NOT NULL,
    PRIMARY KEY (handler, aggregate_id)
) ENGINE = InnoDB;

-- First sighting of a sequence that arrived after a gap (Wait policy).
CREATE TABLE IF NOT EXISTS {{gaps}} (
    handler       VARBINARY(128) NOT NULL,
    aggregate_id  VARBINARY(255) NOT NULL,
    seq           BIGINT         NOT NULL,
    first_seen_at BIGINT         NOT NULL,
    PRIMARY KEY (handler, aggregate_id, seq)
) ENGINE = InnoDB;

-- Write side: the version of each aggregate.
CREATE TABLE IF NOT EXISTS {{versions}} (
    stream       VARBINARY(255) NOT NULL,
    aggregate_id VARBINARY(255) NOT NULL,
    version      BIGINT         NOT NULL,
    PRIMARY KEY (stream, aggregate_id)
) ENGINE = InnoDB;

-- Dead letters. dedupe_key is the SHA-256 of what makes two writes the same
-- dead letter: (handler, message ID, payload hash), or for a delivery that
-- did not decode (handler, source, raw payload, error); NULL when nothing
-- identifies it (no ID and no source), so such rows never merge.
CREATE TABLE IF NOT EXISTS {{dead_letters}} (
    id              BIGINT         NOT NULL AUTO_INCREMENT PRIMARY KEY,
    handler         VARBINARY(128) NOT NULL,
    message_id      VARBINARY(255) NOT NULL DEFAULT '',
    payload_hash    VARBINARY(32)  NOT NULL DEFAULT '',
    dedupe_key      BINARY(32)     NULL,
    envelope        LONGBLOB       NULL,
    raw             LONGBLOB       NULL,
    source          BLOB           NOT NULL,
    error           BLOB           NOT NULL,
    class           VARBINARY(64)  NOT NULL,
    fingerprint     BLOB           NOT NULL,
    attempts        INT            NOT NULL,
    first_failed_at BIGINT         NOT NULL,
    last_failed_at  BIGINT         NOT NULL,
    state           VARCHAR(16)    NOT NULL DEFAULT 'parked',
    UNIQUE KEY {{dead_letters_key}} (dedupe_key),
    KEY {{dead_letters_state}} (state, handler)
) ENGINE = InnoDB;

-- Every state change of a dead letter: who asked, when, and the outcome.
CREATE TABLE IF NOT EXISTS {{dead_letter_log}} (
    id             BIGINT      NOT NULL AUTO_INCREMENT PRIMARY KEY,
    dead_letter_id BIGINT      NOT NULL,
    at             BIGINT      NOT NULL,
    state          VARCHAR(16) NOT NULL,
    actor          BLOB        NOT NULL,
    outcome        BLOB        NOT NULL,
    KEY {{dead_letter_log_dl}} (dead_letter_id)
) ENGINE = InnoDB;

-- Counters of the outcomes that leave no row of their own.
CREATE TABLE IF NOT EXISTS {{handler_stats}} (
    handler    VARBINARY(128) NOT NULL PRIMARY KEY,
    duplicates BIGINT         NOT NULL DEFAULT 0,
    stale      BIGINT         NOT NULL DEFAULT 0,
    updated_at BIGINT         NOT NULL
) ENGINE = InnoDB;

-- Transactional outbox.
CREATE TABLE IF NOT EXISTS {{outbox}} (
    id           BIGINT         NOT NULL AUTO_INCREMENT PRIMARY KEY,
    destination  VARBINARY(255) NOT NULL,
    message_id   VARBINARY(255) NOT NULL,
    ordering_key VARBINARY(255) NOT NULL,
    aggregate_id VARBINARY(255) NOT NULL DEFAULT '',
    seq          BIGINT         NOT NULL DEFAULT 0,
    type         VARBINARY(255) NOT NULL DEFAULT '',
    headers      LONGBLOB       NULL,
    payload      LONGBLOB       NOT NULL,
    payload_hash VARBINARY(32)  NOT NULL,
    created_at   BIGINT         NOT NULL,
    published_at BIGINT         NULL,
    attempts     INT            NOT NULL DEFAULT 0,
    last_error   BLOB           NULL,
    KEY {{outbox_pending}} (published_at, id),
    KEY {{outbox_key}} (ordering_key, published_at, id)
) ENGINE = InnoDB;

-- Relays' claims on ordering keys: one live owner per key; owner '' is a
-- hold after a failed publish.
CREATE TABLE IF NOT EXISTS {{outbox_claims}} (
    ordering_key  VARBINARY(255) NOT NULL PRIMARY KEY,
    owner         VARBINARY(255) NOT NULL,
    claimed_until BIGINT         NOT NULL
) ENGINE = InnoDB;
