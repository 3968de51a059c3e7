package sqlite_test

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/idemhq/idem"
	"github.com/idemhq/idem/driver"
	"github.com/idemhq/idem/sqlite"
)

// openJournal opens a pool of the caller's own, as sql.Open gives it, whose
// connections run in the journal mode the DSN sets.
func openJournal(t *testing.T, file, mode string) *sql.DB {
	t.Helper()
	db, err := sql.Open("sqlite", file+"_txlock=immediate&_pragma=busy_timeout(5000)&_pragma=journal_mode("+mode+")")
	if err != nil {
		t.Fatal(err)
	}
	db.SetMaxOpenConns(1)
	t.Cleanup(func() { db.Close() })
	return db
}

// TestJournalModeRefused: on a pool whose connections run with
// journal_mode=OFF, a batch whose chunk of markers meets an existing one
// kept the rows before it (nothing undid the failed statement) and took
// them for duplicates, so their handlers never ran; MEMORY on a file
// leaves a crash mid-commit nothing to recover with. Migrate refuses
// both, and so does a driver's first transaction or lease claim when the
// file was migrated elsewhere; a check that could not run is not kept.
// An in-memory database, which always journals in memory, is accepted.
func TestJournalModeRefused(t *testing.T) {
	t.Parallel()
	for _, c := range []struct{ name, file, mode string }{
		{"OFF", "", "OFF"},
		{"MEMORY", "", "MEMORY"},
		{"in-memory OFF", "file:journal-off?mode=memory&", "OFF"},
	} {
		t.Run(c.name, func(t *testing.T) {
			t.Parallel()
			ctx := context.Background()
			file := c.file
			if file == "" {
				path := filepath.Join(t.TempDir(), "idem.db")
				// Migrated by another process, as a service migrated
				// with the CLI finds its file.
				good, err := sqlite.Open(path, nil)
				if err != nil {
					t.Fatal(err)
				}
				gdrv, err := sqlite.New(good, nil)
				if err != nil {
					t.Fatal(err)
				}
				if err := gdrv.Migrate(ctx); err != nil {
					t.Fatal(err)
				}
				good.Close()
				file = "file:" + path + "?"
			}
			db := openJournal(t, file, c.mode)
			var mode string
			if err := db.QueryRow(`PRAGMA journal_mode`).Scan(&mode); err != nil || !strings.EqualFold(mode, c.mode) {
				t.Fatalf("the pool's journal mode: %q (%v), want %s", mode, err, c.mode)
			}

			// First use without Migrate: a check that cannot run is no
			// verdict, and is not kept.
			drv, err := sqlite.New(db, nil)
			if err != nil {
				t.Fatal(err)
			}
			cancelled, cancel := context.WithCancel(ctx)
			cancel()
			claim := &driver.LeaseClaimParams{Handler: "h", MessageID: "m", PayloadHash: []byte("x"), Owner: "w", TTL: time.Minute}
			if _, err := drv.LeaseClaim(cancelled, claim); err == nil || errors.Is(err, idem.ErrInvalidConfig) {
				t.Fatalf("LeaseClaim with a cancelled context: %v, want the context's error", err)
			}
			wantRefused := func(what string, err error) {
				t.Helper()
				if !errors.Is(err, idem.ErrInvalidConfig) || !strings.Contains(err.Error(), "journal_mode="+c.mode) {
					t.Fatalf("%s at journal_mode=%s: %v, want an error wrapping ErrInvalidConfig that names the setting", what, c.mode, err)
				}
			}
			_, err = drv.LeaseClaim(ctx, claim)
			wantRefused("LeaseClaim", err)
			tx, err := drv.Begin(ctx)
			if tx != nil {
				tx.Rollback()
			}
			wantRefused("Begin", err)
			_, err = drv.DeadLetterPut(ctx, &driver.DeadLetter{Handler: "h", MessageID: "m", PayloadHash: []byte("x"), Error: "e", Class: "exhausted"})
			wantRefused("DeadLetterPut", err)
			_, _, err = drv.OutboxClaim(ctx, "relay", 10, 0, time.Minute)
			wantRefused("OutboxClaim", err)
			wantRefused("Migrate", drv.Migrate(ctx))
			// Every refused call found the setting; the pool is still
			// usable, and nothing was written.
			var n int
			if err := db.QueryRow(`SELECT count(*) FROM sqlite_schema WHERE name LIKE 'idem_%'`).Scan(&n); err != nil {
				t.Fatal(err)
			}
			if c.file == "" && n == 0 || c.file != "" && n != 0 {
				t.Fatalf("%d idem tables after the refusals", n)
			}
			if c.file == "" {
				if err := db.QueryRow(`SELECT count(*) FROM idem_processed`).Scan(&n); err != nil || n != 0 {
					t.Fatalf("%d markers (%v) after the refusals, want none", n, err)
				}
			}
		})
	}
}

// TestJournalModesAccepted: journal modes that keep a rollback journal
// on disk (and WAL), and an in-memory database, pass Migrate, and a batch
// whose chunk holds an existing marker applies every new message (the
// failed chunk was undone); a handler's failure leaves neither its row
// nor its marker.
func TestJournalModesAccepted(t *testing.T) {
	t.Parallel()
	for _, mode := range []string{"DELETE", "TRUNCATE", "PERSIST", "WAL", "in-memory"} {
		t.Run(mode, func(t *testing.T) {
			t.Parallel()
			ctx := context.Background()
			var db *sql.DB
			if mode == "in-memory" {
				var err error
				if db, err = sqlite.Open(":memory:", nil); err != nil {
					t.Fatal(err)
				}
				t.Cleanup(func() { db.Close() })
			} else {
				db = openJournal(t, "file:"+filepath.Join(t.TempDir(), "idem.db")+"?", mode)
			}
			drv, err := sqlite.New(db, nil)
			if err != nil {
				t.Fatal(err)
			}
			if err := drv.Migrate(ctx); err != nil {
				t.Fatalf("Migrate: %v", err)
			}
			if _, err := db.Exec(`CREATE TABLE effects (id TEXT PRIMARY KEY)`); err != nil {
				t.Fatal(err)
			}
			p, err := idem.NewProcessor(drv, nil)
			if err != nil {
				t.Fatal(err)
			}
			fail := true
			h := &idem.Handler[*sql.Tx]{Name: "h", Apply: func(ctx context.Context, tx *sql.Tx, m *idem.Message) error {
				if _, err := tx.ExecContext(ctx, `INSERT INTO effects VALUES (?)`, m.ID); err != nil {
					return err
				}
				if fail && m.ID == "single" {
					return errors.New("handler failed")
				}
				return nil
			}}
			if _, err := p.Process(ctx, h, &idem.Message{ID: "single", Payload: []byte("x")}); err == nil {
				t.Fatal("the failing handler's message was processed")
			}
			var n int
			if err := db.QueryRow(`SELECT (SELECT count(*) FROM effects) + (SELECT count(*) FROM idem_processed)`).Scan(&n); err != nil || n != 0 {
				t.Fatalf("%d rows (%v) after a handler's failure, want none", n, err)
			}
			fail = false
			if out, err := p.Process(ctx, h, &idem.Message{ID: "m05", Payload: []byte("x")}); err != nil || out != idem.Applied {
				t.Fatalf("m05: %v %v", out, err)
			}
			var msgs []*idem.Message
			for i := range 10 {
				msgs = append(msgs, &idem.Message{ID: fmt.Sprintf("m%02d", i), Payload: []byte("x")})
			}
			outs, err := p.ProcessBatch(ctx, h, msgs)
			if err != nil {
				t.Fatal(err)
			}
			for i, out := range outs {
				if want := map[bool]idem.Outcome{true: idem.Duplicate, false: idem.Applied}[i == 5]; out != want {
					t.Fatalf("batch outcomes %v, want all applied but m05 (a duplicate)", outs)
				}
			}
			if err := db.QueryRow(`SELECT count(*) FROM effects`).Scan(&n); err != nil || n != 10 {
				t.Fatalf("%d effects (%v) after the batch, want 10", n, err)
			}
		})
	}
}
