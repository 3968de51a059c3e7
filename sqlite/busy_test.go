package sqlite_test

import (
	"context"
	"database/sql"
	"fmt"
	"path/filepath"
	"sync"
	"sync/atomic"
	"testing"

	"github.com/idemhq/idem"
	"github.com/idemhq/idem/internal/testenv"
	"github.com/idemhq/idem/sqlite"
)

// TestPoolWithoutBusyTimeout runs four workers on a pool as sql.Open gives
// it: several connections, no busy timeout, deferred transactions (in the
// default rollback journal, and in WAL). Each transaction of the driver
// waits for another's lock: every delivery is applied on its first
// attempt and no collision is taken for the store being down. Without the
// driver's busy timeout a collision failed at once with SQLITE_BUSY: the
// consumer paused for a probe, logged a warning, and gave some deliveries
// a retry verdict.
func TestPoolWithoutBusyTimeout(t *testing.T) {
	for _, dsn := range []string{"", "?_pragma=journal_mode(WAL)"} {
		t.Run("dsn="+dsn, func(t *testing.T) {
			path := filepath.Join(t.TempDir(), "own.db")
			db, err := sql.Open("sqlite", "file:"+path+dsn)
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() { db.Close() })
			var timeout int
			if err := db.QueryRow(`PRAGMA busy_timeout`).Scan(&timeout); err != nil || timeout != 0 {
				t.Fatalf("the pool's busy_timeout: %d, %v; want 0", timeout, err)
			}
			drv, err := sqlite.New(db, nil)
			if err != nil {
				t.Fatal(err)
			}
			ctx := context.Background()
			if err := drv.Migrate(ctx); err != nil {
				t.Fatal(err)
			}
			if _, err := db.Exec(`CREATE TABLE applied (id TEXT NOT NULL)`); err != nil {
				t.Fatal(err)
			}
			p, err := idem.NewProcessor(drv, nil)
			if err != nil {
				t.Fatal(err)
			}
			h := &idem.Handler[*sql.Tx]{Name: "h", Apply: func(ctx context.Context, tx *sql.Tx, m *idem.Message) error {
				_, err := tx.ExecContext(ctx, `INSERT INTO applied (id) VALUES (?)`, m.ID)
				return err
			}}
			down := &outageHook{}
			c, err := idem.NewConsumer(p, h, drv, &idem.ConsumerConfig{Hooks: []idem.Hook{down}, Logger: testenv.Logger(t)})
			if err != nil {
				t.Fatal(err)
			}
			const workers, each = 4, 150
			var (
				wg     sync.WaitGroup
				failed atomic.Int64
			)
			for w := range workers {
				wg.Go(func() {
					for i := range each {
						v := c.HandleDelivery(ctx, &idem.Delivery{Msg: &idem.Message{ID: fmt.Sprintf("%d-%d", w, i), Payload: []byte("x")}, Attempt: 1})
						if !v.Ack || v.Outcome != idem.Applied {
							if failed.Add(1) == 1 {
								t.Errorf("verdict %+v, want Applied", v)
							}
						}
					}
				})
			}
			wg.Wait()
			if n := failed.Load(); n > 0 {
				t.Errorf("%d of %d deliveries not applied on their first attempt", n, workers*each)
			}
			if n := down.downs.Load(); n > 0 {
				t.Errorf("%d outages seen; lock waits are no outage", n)
			}
			var rows, ids int
			if err := db.QueryRow(`SELECT count(*), count(DISTINCT id) FROM applied`).Scan(&rows, &ids); err != nil {
				t.Fatal(err)
			}
			if rows != workers*each || ids != workers*each {
				t.Errorf("%d effects of %d messages, want %d of %d", rows, ids, workers*each, workers*each)
			}
		})
	}
}
