-- A delivery that did not decode has no message ID. Its dead letter is
-- found again by the broker location, payload and error (the same delivery,
-- redelivered after a crash before the ack), so that it updates the row it
-- wrote instead of adding a second one.
CREATE INDEX IF NOT EXISTS {{dead_letters_source}} ON {{dead_letters}} (handler, source) WHERE message_id = '';
