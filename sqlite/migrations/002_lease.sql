-- Lease mode: the same marker table, with the columns of a lease. Atomic mode's
-- INSERT is unchanged: its rows take the defaults (status 'done', token 0,
-- attempts 0, the rest NULL), a few bytes per row, and lease mode reads them
-- as done.
ALTER TABLE {{processed}} ADD COLUMN status TEXT NOT NULL DEFAULT 'done'
    CHECK (status IN ('running', 'done', 'failed'));
ALTER TABLE {{processed}} ADD COLUMN owner TEXT;              -- worker that last claimed the row
ALTER TABLE {{processed}} ADD COLUMN lease_until INTEGER;     -- Unix microseconds; running rows only
ALTER TABLE {{processed}} ADD COLUMN token INTEGER NOT NULL DEFAULT 0; -- fencing token: +1 per claim
ALTER TABLE {{processed}} ADD COLUMN attempts INTEGER NOT NULL DEFAULT 0;
ALTER TABLE {{processed}} ADD COLUMN next_attempt_at INTEGER; -- Unix microseconds; NULL on a failed row: never
ALTER TABLE {{processed}} ADD COLUMN last_error TEXT;
