-- The outbox's NOTIFY trigger becomes opt-in (Driver.SetOutboxNotify). A
-- transaction that notifies takes a database-wide lock at commit, held
-- until its commit record is flushed, so concurrent writers of outbox rows
-- committed one at a time: with 4 writers a business transaction plus its
-- outbox row ran at 0.65 of the rate it had without the trigger, with 8 at
-- 0.49 (pgbench). Relays poll every PollInterval instead; the function
-- stays for SetOutboxNotify.
DROP TRIGGER IF EXISTS {{outbox_notify}} ON {{outbox}};
