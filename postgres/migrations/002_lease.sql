-- Lease mode: the same marker table, with the columns of a lease. Atomic mode's
-- INSERT is unchanged: its rows take the defaults (status 'done', token 0,
-- attempts 0, the rest NULL), a few bytes per row, and lease mode reads them
-- as done.
--
-- Constant defaults make every ADD COLUMN a catalog-only change (no table
-- rewrite), and the CHECK is NOT VALID so that adding it does not scan the
-- existing markers; it still holds for every row written from now on. A CHECK
-- constraint name is local to its table, so it needs no prefix.
ALTER TABLE {{processed}}
    ADD COLUMN IF NOT EXISTS status          text        NOT NULL DEFAULT 'done',
    ADD COLUMN IF NOT EXISTS owner           text,                       -- worker that last claimed the row
    ADD COLUMN IF NOT EXISTS lease_until     timestamptz,                -- running rows only
    ADD COLUMN IF NOT EXISTS token           bigint      NOT NULL DEFAULT 0, -- fencing token: +1 per claim
    ADD COLUMN IF NOT EXISTS attempts        integer     NOT NULL DEFAULT 0,
    ADD COLUMN IF NOT EXISTS next_attempt_at timestamptz,                -- NULL on a failed row: never
    ADD COLUMN IF NOT EXISTS last_error      text;

ALTER TABLE {{processed}}
    ADD CONSTRAINT lease_status_check CHECK (status IN ('running', 'done', 'failed')) NOT VALID;
