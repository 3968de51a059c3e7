package main

import (
	"context"
	"database/sql"
	"path/filepath"
	"strings"
	"testing"

	"github.com/idemhq/idem"
	"github.com/idemhq/idem/driver"
	"github.com/idemhq/idem/internal/testenv"
	"github.com/idemhq/idem/outbox"
	"github.com/idemhq/idem/postgres"
	"github.com/idemhq/idem/redisstore"
	"github.com/idemhq/idem/sqlite"
)

func TestParseOutboxID(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		stream, agg string
		seq         int64
	}{{"orders", "o-1", 7}, {"orders-eu", "7", 1}, {"a.b", "", 12}, {"x:y-z", "q-r-s", 9223372036854775807}} {
		k, seq, ok := parseOutboxID(outbox.MessageID(tc.stream, tc.agg, tc.seq))
		if !ok || k != (aggKey{tc.stream, tc.agg}) || seq != tc.seq {
			t.Errorf("%q/%q/%d: got %+v %d %v", tc.stream, tc.agg, tc.seq, k, seq, ok)
		}
	}
	for _, id := range []string{"order-1", "6:orders-o-1-", "6:orders-o-1-0", "6:orders-o-1-01", "9:orders-o-1-2", "x:orders-o-1-2", "6:orders", "-1:a-b-1"} {
		if k, seq, ok := parseOutboxID(id); ok {
			t.Errorf("%q parsed as %+v %d", id, k, seq)
		}
	}
}

// addNext adds one event per payload to aggregate agg of stream "orders"
// through the outbox, in one transaction per event, and returns them.
func addNext[TTx any](t *testing.T, ob *outbox.Outbox[TTx], begin func() TTx, commit func(TTx), agg string, payloads ...string) []*idem.Message {
	t.Helper()
	var msgs []*idem.Message
	for _, p := range payloads {
		tx := begin()
		m, err := ob.AddNext(context.Background(), tx, "orders", agg, "OrderPlaced", []byte(p))
		if err != nil {
			t.Fatal(err)
		}
		commit(tx)
		msgs = append(msgs, m)
	}
	return msgs
}

// deliver hands msgs to a consumer on drv, as a relay and broker would,
// and returns the outcomes.
func deliver[TTx any](t *testing.T, drv interface {
	driver.Driver[TTx]
	driver.DeadLetterStore
}, msgs ...*idem.Message) []idem.Outcome {
	t.Helper()
	p, err := idem.NewProcessor(drv, nil)
	if err != nil {
		t.Fatal(err)
	}
	c, err := idem.NewConsumer(p, &idem.Handler[TTx]{Name: "billing", Apply: func(context.Context, TTx, *idem.Message) error { return nil }}, drv, &idem.ConsumerConfig{Logger: testenv.Logger(t)})
	if err != nil {
		t.Fatal(err)
	}
	var outs []idem.Outcome
	for _, m := range msgs {
		outs = append(outs, c.HandleDelivery(context.Background(), &idem.Delivery{Msg: m, Attempt: 1}).Outcome)
	}
	return outs
}

// TestOutboxCheckAfterRestoreSQLite: a producer's database restored from a
// backup re-issues message IDs the consumer has already applied, and the
// consumer dead-letters the re-issued one as a conflict. outbox check
// finds the sequence behind and the re-issued ID; --fix advances the
// sequence, and the next event gets a fresh ID the consumer applies.
func TestOutboxCheckAfterRestoreSQLite(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	dir := t.TempDir()
	live, backup, consumerPath := filepath.Join(dir, "live.db"), filepath.Join(dir, "backup.db"), filepath.Join(dir, "consumer.db")
	db, drv := testenv.SQLite(t, live, nil)
	_, cdrv := testenv.SQLite(t, consumerPath, nil)
	sqliteOutbox := func(db *sql.DB, drv *sqlite.Driver) func(agg string, payloads ...string) []*idem.Message {
		ob, err := outbox.New(drv)
		if err != nil {
			t.Fatal(err)
		}
		begin := func() *sql.Tx {
			tx, err := db.BeginTx(ctx, nil)
			if err != nil {
				t.Fatal(err)
			}
			return tx
		}
		commit := func(tx *sql.Tx) {
			if err := tx.Commit(); err != nil {
				t.Fatal(err)
			}
		}
		return func(agg string, payloads ...string) []*idem.Message {
			return addNext(t, ob, begin, commit, agg, payloads...)
		}
	}
	add := sqliteOutbox(db, drv)
	published := add("o-1", "first")
	published = append(published, add("o-2", "other")...)
	if _, err := db.ExecContext(ctx, `VACUUM INTO ?`, backup); err != nil {
		t.Fatal(err)
	}
	published = append(published, add("o-1", "second", "third")...)
	deliver(t, cdrv, published...)

	// The restore: the producer runs on the backup from now on.
	rdb, rdrv := testenv.SQLite(t, backup, nil)
	check := func(args ...string) (int, string) {
		t.Helper()
		code, out, errOut := runCLI(t, append([]string{"outbox", "check", "--dsn", backup, "--consumer", consumerPath}, args...)...)
		return code, out + errOut
	}
	code, out := check()
	if code != exitFailed || !strings.Contains(out, "orders  o-1        1         3             markers of SQLite "+consumerPath) ||
		strings.Contains(out, "o-2") || !strings.Contains(out, "found 1 sequence behind") {
		t.Fatalf("check after restore: exit %d\n%s", code, out)
	}

	// Without the fix, the next event re-issues an applied ID with another
	// payload: a conflict.
	radd := sqliteOutbox(rdb, rdrv)
	reissued := radd("o-1", "fourth")
	if reissued[0].ID != published[2].ID {
		t.Fatalf("restored outbox issued %s, want the re-issued %s", reissued[0].ID, published[2].ID)
	}
	if outs := deliver(t, cdrv, reissued...); outs[0] != idem.Conflict {
		t.Fatalf("re-issued ID: %v, want conflict", outs)
	}
	code, out = check()
	id := published[2].ID
	if code != exitFailed || !strings.Contains(out, "orders  o-1        2         3") ||
		!strings.Contains(out, "1 message ID in the outbox issued before with another payload") ||
		!strings.Contains(out, "  "+id+"  (dead letters of SQLite "+consumerPath+"; markers of SQLite "+consumerPath+")") {
		t.Fatalf("check after a re-issued ID: exit %d\n%s", code, out)
	}

	code, out = check("--fix")
	if code != exitOK || !strings.Contains(out, "advanced 1 sequence past the message IDs already issued") {
		t.Fatalf("check --fix: exit %d\n%s", code, out)
	}
	if code, out = check(); code != exitOK || !strings.Contains(out, "no sequence is behind") {
		t.Fatalf("check after --fix: exit %d\n%s", code, out)
	}
	next := radd("o-1", "fifth")
	if next[0].Seq != 4 {
		t.Fatalf("after --fix the outbox issued seq %d, want 4", next[0].Seq)
	}
	if outs := deliver(t, cdrv, next...); outs[0] != idem.Applied {
		t.Fatalf("after --fix: %v, want applied", outs)
	}
}

// TestOutboxCheckAfterRestorePostgres: the same on PostgreSQL, with the
// consumer's markers in another schema. The restore is done by hand: the
// sequence row and the outbox rows go back to an earlier state.
func TestOutboxCheckAfterRestorePostgres(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	schema, drv := migratedSchema(t)
	cschema, cdrv := migratedSchema(t)
	pool := testenv.PostgresPool(t, 2)
	ob, err := outbox.New(drv)
	if err != nil {
		t.Fatal(err)
	}
	begin := func() postgres.Tx {
		tx, err := pool.Begin(ctx)
		if err != nil {
			t.Fatal(err)
		}
		return tx
	}
	commit := func(tx postgres.Tx) {
		if err := tx.(interface{ Commit(context.Context) error }).Commit(ctx); err != nil {
			t.Fatal(err)
		}
	}
	msgs := addNext(t, ob, begin, commit, "o-1", "first", "second", "third")
	deliver(t, cdrv, msgs...)
	if _, err := pool.Exec(ctx, `UPDATE `+schema+`.idem_versions SET version = 1; DELETE FROM `+schema+`.idem_outbox WHERE seq > 1`); err != nil {
		t.Fatal(err)
	}
	args := []string{"outbox", "check", "--dsn", testenv.PostgresDSN(), "--schema", schema, "--consumer", testenv.PostgresDSN(), "--consumer-schema", cschema}
	code, out, errOut := runCLI(t, args...)
	if code != exitFailed || !strings.Contains(out, "orders  o-1        1         3             markers of PostgreSQL") {
		t.Fatalf("check after restore: exit %d\n%s%s", code, out, errOut)
	}
	if code, out, errOut = runCLI(t, append(args, "--fix")...); code != exitOK {
		t.Fatalf("check --fix: exit %d\n%s%s", code, out, errOut)
	}
	if next := addNext(t, ob, begin, commit, "o-1", "fourth"); next[0].Seq != 4 {
		t.Fatalf("after --fix the outbox issued seq %d, want 4", next[0].Seq)
	}
}

// TestOutboxCheckRedisConsumer: the issued IDs are found in a consumer's
// Redis markers too.
func TestOutboxCheckRedisConsumer(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	client, prefix := testenv.Redis(t)
	cdrv, err := redisstore.New(client, &redisstore.Config{Prefix: prefix})
	if err != nil {
		t.Fatal(err)
	}
	path := filepath.Join(t.TempDir(), "producer.db")
	db, drv := testenv.SQLite(t, path, nil)
	ob, err := outbox.New(drv)
	if err != nil {
		t.Fatal(err)
	}
	begin := func() *sql.Tx {
		tx, err := db.BeginTx(ctx, nil)
		if err != nil {
			t.Fatal(err)
		}
		return tx
	}
	commit := func(tx *sql.Tx) {
		if err := tx.Commit(); err != nil {
			t.Fatal(err)
		}
	}
	deliver(t, cdrv, addNext(t, ob, begin, commit, "o-1", "first", "second")...)
	if _, err := db.ExecContext(ctx, `UPDATE idem_versions SET version = 1; DELETE FROM idem_outbox WHERE seq > 1`); err != nil {
		t.Fatal(err)
	}
	args := []string{"outbox", "check", "--dsn", path, "--consumer", testenv.RedisURL(), "--consumer-prefix", prefix}
	code, out, errOut := runCLI(t, args...)
	if code != exitFailed || !strings.Contains(out, "orders  o-1        1         2             markers of Redis") {
		t.Fatalf("check: exit %d\n%s%s", code, out, errOut)
	}
	if code, out, errOut = runCLI(t, append(args, "--fix")...); code != exitOK {
		t.Fatalf("check --fix: exit %d\n%s%s", code, out, errOut)
	}
	if next := addNext(t, ob, begin, commit, "o-1", "third"); next[0].Seq != 3 {
		t.Fatalf("after --fix the outbox issued seq %d, want 3", next[0].Seq)
	}
}

// FuzzParseOutboxID: any stored message ID parses without a panic, and
// parses exactly when it is the ID outbox.MessageID makes of what it
// parses to; every ID MessageID makes parses back to its parts.
func FuzzParseOutboxID(f *testing.F) {
	f.Add("orders", "o-1", int64(3), "5:orders-o-1-3")
	f.Add("", "", int64(1), "0:-")
	f.Add("a-b", "c-d-e", int64(9223372036854775807), "3:a-b--1")
	f.Add("s\x00", "\xff", int64(-1), "99999999999999999999:x")
	f.Add("x", "y", int64(0), "-1:x-y-1")
	f.Fuzz(func(t *testing.T, stream, agg string, seq int64, raw string) {
		if k, n, ok := parseOutboxID(raw); ok && outbox.MessageID(k.stream, k.aggregate, n) != raw {
			t.Fatalf("%q parsed to (%q, %q, %d), which makes another ID", raw, k.stream, k.aggregate, n)
		}
		if seq < 1 {
			return
		}
		id := outbox.MessageID(stream, agg, seq)
		k, n, ok := parseOutboxID(id)
		if !ok || k.stream != stream || k.aggregate != agg || n != seq {
			t.Fatalf("MessageID(%q, %q, %d) = %q parsed to (%q, %q, %d, %v)", stream, agg, seq, id, k.stream, k.aggregate, n, ok)
		}
	})
}

// TestOutboxCheckRedisConsumerDeadLetters: an issued ID a consumer's
// Redis store holds only as a dead letter counts as issued. The check
// read the dead letters' index keys as "handler|message ID", but they
// end with a NUL and the payload hash, so no dead letter's ID ever
// parsed and a sequence behind one was reported as fine.
func TestOutboxCheckRedisConsumerDeadLetters(t *testing.T) {
	ctx := context.Background()
	client, prefix := testenv.Redis(t)
	cdrv, err := redisstore.New(client, &redisstore.Config{Prefix: prefix})
	if err != nil {
		t.Fatal(err)
	}
	path := filepath.Join(t.TempDir(), "producer.db")
	db, _ := testenv.SQLite(t, path, nil)
	if _, err := db.ExecContext(ctx, `INSERT INTO idem_versions (stream, aggregate_id, version) VALUES ('orders', 'o-1', 1)`); err != nil {
		t.Fatal(err)
	}
	if _, err := cdrv.DeadLetterPut(ctx, &driver.DeadLetter{Handler: "billing", MessageID: outbox.MessageID("orders", "o-1", 3),
		PayloadHash: []byte{1, 2, 3}, Error: "boom", Class: "permanent", Attempts: 1}); err != nil {
		t.Fatal(err)
	}
	args := []string{"outbox", "check", "--dsn", path, "--consumer", testenv.RedisURL(), "--consumer-prefix", prefix}
	code, out, errOut := runCLI(t, args...)
	if code != exitFailed || !strings.Contains(out, "orders  o-1        1         3             dead letters of Redis") {
		t.Fatalf("check: exit %d, want %d and the sequence behind the dead letter\n%s%s", code, exitFailed, out, errOut)
	}
	if code, out, errOut = runCLI(t, append(args, "--fix")...); code != exitOK {
		t.Fatalf("check --fix: exit %d\n%s%s", code, out, errOut)
	}
	var v int64
	if err := db.QueryRowContext(ctx, `SELECT version FROM idem_versions WHERE stream = 'orders' AND aggregate_id = 'o-1'`).Scan(&v); err != nil || v != 3 {
		t.Fatalf("after --fix: version %d, %v; want 3", v, err)
	}
}

// TestOutboxCheckRedisPrefixIsNoPattern: a --consumer-prefix holding a
// character SCAN reads as a wildcard ('?' here) reads that prefix's
// markers only, not those of every prefix the pattern matches: another
// store's markers made a sequence look behind, and --fix would have
// advanced it.
func TestOutboxCheckRedisPrefixIsNoPattern(t *testing.T) {
	client, base := testenv.Redis(t)
	other, err := redisstore.New(client, &redisstore.Config{Prefix: base + "ab:"})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := redisstore.New(client, &redisstore.Config{Prefix: base + "a?:"}); err != nil {
		t.Fatal(err)
	}
	path := filepath.Join(t.TempDir(), "producer.db")
	db, _ := testenv.SQLite(t, path, nil)
	if _, err := db.Exec(`INSERT INTO idem_versions (stream, aggregate_id, version) VALUES ('orders', 'o-1', 1)`); err != nil {
		t.Fatal(err)
	}
	deliver(t, other, &idem.Message{ID: outbox.MessageID("orders", "o-1", 3), Payload: []byte("x")})
	code, out, errOut := runCLI(t, "outbox", "check", "--dsn", path, "--consumer", testenv.RedisURL(), "--consumer-prefix", base+"a?:")
	if code != exitOK || !strings.Contains(out, "no sequence is behind") {
		t.Fatalf("check of prefix %q: exit %d, want %d: the markers under %q are another store's\n%s%s", base+"a?:", code, exitOK, base+"ab:", out, errOut)
	}
}
