package sqlite_test

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"path/filepath"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/idemhq/idem"
	"github.com/idemhq/idem/driver"
	"github.com/idemhq/idem/internal/testenv"
	"github.com/idemhq/idem/sqlite"
)

// Probe fails while another connection holds the write lock past the busy
// timeout, and the error it met looks like an outage; both pass once the
// lock goes.
func TestUnavailableAndProbe(t *testing.T) {
	t.Parallel()
	path := filepath.Join(t.TempDir(), "idem.db")
	db, drv := testenv.SQLite(t, path, &sqlite.OpenOptions{BusyTimeout: 20 * time.Millisecond})
	ctx := context.Background()
	if err := drv.Probe(ctx); err != nil {
		t.Fatalf("Probe of a free database: %v", err)
	}
	other, err := sqlite.Open(path, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer other.Close()
	lock, err := other.Conn(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer lock.Close()
	if _, err := lock.ExecContext(ctx, "BEGIN EXCLUSIVE"); err != nil {
		t.Fatal(err)
	}
	perr := drv.Probe(ctx)
	if perr == nil || !drv.Unavailable(perr) {
		t.Fatalf("Probe of a locked database: %v, want an error that looks like an outage", perr)
	}
	_, werr := db.ExecContext(ctx, "CREATE TABLE t (x)")
	if werr == nil || !drv.Unavailable(werr) {
		t.Fatalf("a write to a locked database: %v, want an error that looks like an outage", werr)
	}
	if _, err := lock.ExecContext(ctx, "ROLLBACK"); err != nil {
		t.Fatal(err)
	}
	if err := drv.Probe(ctx); err != nil {
		t.Fatalf("Probe once the lock went: %v", err)
	}
	if _, err := db.ExecContext(ctx, "SELECT * FROM no_such_table"); err == nil || drv.Unavailable(err) {
		t.Fatalf("a missing table looks like an outage: %v", err)
	}
	if drv.Unavailable(errors.New("plain")) || drv.Unavailable(nil) {
		t.Fatal("a plain error looks like an outage")
	}
}

// TestProbeNeedsAWrite: a database the process may only read, and one
// whose pool begins transactions deferred (no lock until the first
// write), both let a BEGIN through; the probe must still find that no
// write can happen, with an error that looks like an outage.
func TestProbeNeedsAWrite(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	path := filepath.Join(t.TempDir(), "idem.db")
	_, drv := testenv.SQLite(t, path, nil)
	if err := drv.Probe(ctx); err != nil {
		t.Fatalf("Probe of a writable database: %v", err)
	}
	ro, err := sql.Open("sqlite", "file:"+path+"?mode=ro&_txlock=immediate")
	if err != nil {
		t.Fatal(err)
	}
	defer ro.Close()
	roDrv, err := sqlite.New(ro, nil)
	if err != nil {
		t.Fatal(err)
	}
	if perr := roDrv.Probe(ctx); perr == nil || !roDrv.Unavailable(perr) {
		t.Fatalf("Probe of a read-only database: %v, want an error that looks like an outage", perr)
	}

	deferred, err := sql.Open("sqlite", "file:"+path+"?_pragma=busy_timeout(20)")
	if err != nil {
		t.Fatal(err)
	}
	defer deferred.Close()
	defDrv, err := sqlite.New(deferred, nil)
	if err != nil {
		t.Fatal(err)
	}
	lock, err := sqlite.Open(path, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer lock.Close()
	c, err := lock.Conn(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	if _, err := c.ExecContext(ctx, "BEGIN IMMEDIATE"); err != nil {
		t.Fatal(err)
	}
	defer c.ExecContext(ctx, "ROLLBACK")
	if perr := defDrv.Probe(ctx); perr == nil || !defDrv.Unavailable(perr) {
		t.Fatalf("Probe on a deferred pool while another holds the write lock: %v, want an error that looks like an outage", perr)
	}
}

// TestProbeCommitsAWrite: the probe's write reaches the database (another
// connection sees a commit), as it must for a disk with no room for it to
// fail the probe; a probe that rolls back writes nothing in WAL mode.
// The database's content is unchanged.
func TestProbeCommitsAWrite(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	path := filepath.Join(t.TempDir(), "idem.db")
	db, drv := testenv.SQLite(t, path, nil)
	other, err := sqlite.Open(path, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer other.Close()
	version := func() (v int64) {
		t.Helper()
		if err := other.QueryRowContext(ctx, `PRAGMA data_version`).Scan(&v); err != nil {
			t.Fatal(err)
		}
		return v
	}
	var before int
	if err := db.QueryRowContext(ctx, `SELECT count(*) FROM idem_migrations`).Scan(&before); err != nil {
		t.Fatal(err)
	}
	v := version()
	if err := drv.Probe(ctx); err != nil {
		t.Fatal(err)
	}
	if version() == v {
		t.Fatal("the probe committed nothing")
	}
	var after int
	if err := db.QueryRowContext(ctx, `SELECT count(*) FROM idem_migrations`).Scan(&after); err != nil {
		t.Fatal(err)
	}
	if after != before {
		t.Fatalf("%d migrations recorded after the probe, %d before", after, before)
	}
}

// outageHook counts a consumer's outages.
type outageHook struct{ downs, ups atomic.Int64 }

func (h *outageHook) OnOutage(_ context.Context, ev *idem.OutageEvent) {
	if ev.Down {
		h.downs.Add(1)
	} else {
		h.ups.Add(1)
	}
}

// TestFullDatabaseIsAnOutage: a database that cannot grow (here capped
// by max_page_count, as a full disk stops it) fails a delivery's marker
// insert with SQLITE_FULL. Probe fails too, so a consumer holds the
// delivery as an outage: no attempt spent, no dead letter on the broker's
// last delivery; once the limit is raised the probe passes and the held
// delivery applies. A probe that allocated nothing passed while full, and
// each delivery failed as an attempt and went to the dead letters.
func TestFullDatabaseIsAnOutage(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db, drv := testenv.SQLite(t, filepath.Join(t.TempDir(), "idem.db"), &sqlite.OpenOptions{Synchronous: "OFF"})
	if _, err := db.ExecContext(ctx, `CREATE TABLE seen (id TEXT PRIMARY KEY); CREATE TABLE filler (pad BLOB)`); err != nil {
		t.Fatal(err)
	}
	p, err := idem.NewProcessor(drv, nil)
	if err != nil {
		t.Fatal(err)
	}
	h := &idem.Handler[*sql.Tx]{Name: "h", Apply: func(ctx context.Context, tx *sql.Tx, m *idem.Message) error {
		_, err := tx.ExecContext(ctx, `INSERT INTO seen VALUES (?)`, m.ID)
		return err
	}}
	// Cap the database at its size, use up its free pages, then fill the
	// marker table's last page: the next marker in the same place needs
	// a page the database cannot have.
	var pages int
	if err := db.QueryRowContext(ctx, `PRAGMA page_count`).Scan(&pages); err != nil {
		t.Fatal(err)
	}
	if _, err := db.ExecContext(ctx, fmt.Sprintf(`PRAGMA max_page_count = %d`, pages)); err != nil {
		t.Fatal(err)
	}
	for i := 0; ; i++ {
		_, err := db.ExecContext(ctx, `INSERT INTO filler VALUES (zeroblob(500))`)
		if err != nil {
			if !drv.Unavailable(err) {
				t.Fatalf("filling the database: %v, want SQLITE_FULL", err)
			}
			break
		}
		if i > 100000 {
			t.Fatal("the database never filled")
		}
	}
	const pad = "padding-padding-padding-padding-padding-padding-padding"
	for i := 0; ; i++ {
		_, err := p.Process(ctx, h, &idem.Message{ID: fmt.Sprintf("fill-%04d-%s", i, pad), Payload: []byte("x")})
		if err != nil {
			if !drv.Unavailable(err) || !strings.Contains(err.Error(), "insert marker") {
				t.Fatalf("filling the marker table: %v, want SQLITE_FULL from the marker's insert", err)
			}
			break
		}
		if i > 10000 {
			t.Fatal("the marker table never filled")
		}
	}
	if perr := drv.Probe(ctx); perr == nil || !drv.Unavailable(perr) {
		t.Fatalf("Probe of a full database: %v, want an error that looks like an outage", perr)
	}

	hook := &outageHook{}
	c, err := idem.NewConsumer(p, h, drv, &idem.ConsumerConfig{MaxAttempts: 1, Hooks: []idem.Hook{hook}, Logger: testenv.Logger(t),
		ProbeBackoff: idem.Backoff{Base: 10 * time.Millisecond, Max: 50 * time.Millisecond}})
	if err != nil {
		t.Fatal(err)
	}
	// IDs as long as the fillers', sorted after them: their markers go
	// to the full page.
	a, b := "zz-a-0000-"+pad, "zz-b-0000-"+pad

	// Stopped while the database is full: no attempt, no dead letter.
	stop := make(chan struct{})
	time.AfterFunc(300*time.Millisecond, func() { close(stop) })
	v := c.HandleDelivery(ctx, &idem.Delivery{Msg: &idem.Message{ID: a, Payload: []byte("x")}, Attempt: 1, LastAttempt: true, Stopping: stop})
	if v.Ack || v.DeadLettered || !errors.Is(v.Err, idem.ErrStoreUnavailable) {
		t.Fatalf("verdict of a delivery stopped while the database is full: %+v, want a retry with ErrStoreUnavailable", v)
	}
	if hook.downs.Load() != 1 {
		t.Fatalf("%d outages reported, want 1", hook.downs.Load())
	}

	// Held, then applied once the limit is raised.
	done := make(chan idem.Verdict, 1)
	go func() {
		done <- c.HandleDelivery(ctx, &idem.Delivery{Msg: &idem.Message{ID: b, Payload: []byte("x")}, Attempt: 1, LastAttempt: true})
	}()
	select {
	case v := <-done:
		t.Fatalf("decided while the database was full: %+v", v)
	case <-time.After(300 * time.Millisecond):
	}
	if _, err := db.ExecContext(ctx, `PRAGMA max_page_count = 1000000`); err != nil {
		t.Fatal(err)
	}
	select {
	case v := <-done:
		if !v.Ack || v.Outcome != idem.Applied {
			t.Fatalf("after the limit was raised: %+v, want applied", v)
		}
	case <-time.After(5 * time.Second):
		t.Fatal("not decided 5 s after the limit was raised")
	}
	if err := drv.Probe(ctx); err != nil {
		t.Fatalf("Probe once the limit was raised: %v", err)
	}
	if hook.ups.Load() != 1 {
		t.Fatalf("%d outage ends reported, want 1", hook.ups.Load())
	}
	dls, err := drv.DeadLetterList(ctx, &driver.DeadLetterFilter{})
	if err != nil || len(dls) != 0 {
		t.Fatalf("dead letters: %d (%v), want none", len(dls), err)
	}
	var seen int
	if err := db.QueryRowContext(ctx, `SELECT count(*) FROM seen WHERE id = ?`, b).Scan(&seen); err != nil || seen != 1 {
		t.Fatalf("b applied %d times (%v), want once", seen, err)
	}
}
