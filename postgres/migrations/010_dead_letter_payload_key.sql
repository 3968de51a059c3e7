-- A dead letter is keyed by (handler, message ID, payload hash): the same
-- message ID failing again with another payload is a second dead letter,
-- so the first payload stays as evidence. Rows written before keep an
-- empty hash; the driver matches them by their raw payload and fills it in.
ALTER TABLE {{dead_letters}} ADD COLUMN IF NOT EXISTS payload_hash text NOT NULL DEFAULT '';
CREATE UNIQUE INDEX IF NOT EXISTS {{dead_letters_payload_key}} ON {{dead_letters}} (handler, message_id, payload_hash) WHERE message_id <> '';
DROP INDEX IF EXISTS {{dead_letters_key_qualified}};

-- A consumer claims a dead letter for its replay by moving it to the new
-- state 'replaying', so that two consumers never run one at once. The
-- state's CHECK was named by the server: found by its definition.
DO $$
DECLARE c name;
BEGIN
  FOR c IN SELECT conname FROM pg_constraint
           WHERE conrelid = '{{dead_letters}}'::regclass AND contype = 'c'
             AND pg_get_constraintdef(oid) LIKE '%replay_requested%'
  LOOP
    EXECUTE format('ALTER TABLE {{dead_letters}} DROP CONSTRAINT %I', c);
  END LOOP;
END $$;
ALTER TABLE {{dead_letters}} ADD CONSTRAINT {{dead_letters_state_check}}
    CHECK (state IN ('parked', 'replay_requested', 'replaying', 'replayed', 'discarded'));
