package mysql_test

import (
	"context"
	"database/sql"
	"errors"
	"strconv"
	"sync/atomic"
	"testing"
	"time"

	gomysql "github.com/go-sql-driver/mysql"

	"github.com/idemhq/idem"
	"github.com/idemhq/idem/idemtest"
	"github.com/idemhq/idem/internal/testenv"
	"github.com/idemhq/idem/mysql"
)

// TestStopCutsAHungCommit: the path to the server dies (no reset, no
// answer) as the COMMIT goes out. database/sql's Commit takes no context,
// so a stop used to wait on it as long as TCP keeps trying; a pool from
// mysql.Open sends it under the transaction's context, which the stop's
// StopGrace cancels: the delivery is handed back as no attempt and,
// delivered again once the path is back, applies once.
func TestStopCutsAHungCommit(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	cfg, err := gomysql.ParseDSN(testenv.MySQLDatabase(t))
	if err != nil {
		t.Fatal(err)
	}
	hole := testenv.NewBlackhole(t, cfg.Addr)
	cfg.Addr = "127.0.0.1:" + strconv.Itoa(hole.Port())
	s := storeOn(t, openFolded(t, cfg.FormatDSN(), 4), &mysql.Config{SessionIsolation: true})
	t.Cleanup(hole.Close) // first: the database's drop waits for the hung session's locks
	p, err := idem.NewProcessor(s.Driver, nil)
	if err != nil {
		t.Fatal(err)
	}
	credit := idemtest.CreditHandler(s, "balances", nil)
	var calls atomic.Int32
	entered := make(chan struct{})
	h := &idem.Handler[*sql.Tx]{Name: credit.Name, Apply: func(ctx context.Context, tx *sql.Tx, m *idem.Message) error {
		if err := credit.Apply(ctx, tx, m); err != nil {
			return err
		}
		if calls.Add(1) == 1 {
			hole.Cut() // the COMMIT goes out on a dead path
			close(entered)
		}
		return nil
	}}
	const grace = time.Second
	c, err := idem.NewConsumer(p, h, s.Driver.(*mysql.Driver), &idem.ConsumerConfig{StopGrace: grace, Logger: testenv.Logger(t)})
	if err != nil {
		t.Fatal(err)
	}
	events := idemtest.Events(1)
	stop := make(chan struct{})
	res := make(chan idem.Verdict, 1)
	go func() {
		res <- c.HandleDelivery(ctx, &idem.Delivery{Msg: events[0].Message(), Attempt: 1, Stopping: stop, Source: "test"})
	}()
	<-entered
	time.Sleep(100 * time.Millisecond)
	close(stop)
	select {
	case v := <-res:
		if v.Ack || !errors.Is(v.Err, idem.ErrStopped) {
			t.Fatalf("verdict %+v; want a retry matching ErrStopped", v)
		}
	case <-time.After(grace + 10*time.Second):
		t.Fatalf("still deciding %s after the stop (StopGrace %s): the COMMIT waits on a dead path", grace+10*time.Second, grace)
	}

	hole.Reset() // the path is back: the server rolls the hung session back
	if v := c.HandleDelivery(ctx, &idem.Delivery{Msg: events[0].Message(), Attempt: 1}); !v.Ack || v.Outcome != idem.Applied {
		t.Fatalf("delivered again: %+v; want applied (the cut COMMIT never reached the server)", v)
	}
	got, err := s.Balances(ctx)
	if err != nil {
		t.Fatal(err)
	}
	for a, n := range idemtest.Expected(events) {
		if got[a] != n || len(got) != 1 {
			t.Fatalf("balances %v; want %s = %d", got, a, n)
		}
	}
}
