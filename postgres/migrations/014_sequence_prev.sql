-- An ordered batch advances its aggregates' sequences with one upsert that
-- decides in SQL (SequenceAdvanceMany). PostgreSQL before 18 cannot
-- RETURNING a row's old values, so the upsert keeps the value it replaced
-- in prev_seq and returns that. A constant default rewrites nothing.
ALTER TABLE {{sequences}} ADD COLUMN IF NOT EXISTS prev_seq bigint NOT NULL DEFAULT 0;
