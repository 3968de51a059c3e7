package watermill_test

import (
	"context"
	"database/sql"
	"errors"
	"path/filepath"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/pubsub/gochannel"

	"github.com/idemhq/idem"
	"github.com/idemhq/idem/internal/testenv"
	idemwm "github.com/idemhq/idem/watermill"
)

// Router.Close ends the context of the messages in flight (GoChannel,
// watermill-amqp, watermill-sql). A message whose transaction is under
// way then is not failing: its delivery is stopping. It must not be
// counted as a failed attempt, and with MaxAttempts reached must not be
// dead-lettered as exhausted: it commits within the router's
// CloseTimeout, as the other adapters let it, and is applied once.
func TestRouterCloseDoesNotFailTheMessageInFlight(t *testing.T) {
	t.Parallel()
	path := filepath.Join(t.TempDir(), "idem.db")
	db, drv := testenv.SQLite(t, path, nil)
	if _, err := db.Exec(`CREATE TABLE seen (id TEXT PRIMARY KEY)`); err != nil {
		t.Fatal(err)
	}
	p, err := idem.NewProcessor(drv, nil)
	if err != nil {
		t.Fatal(err)
	}
	started := make(chan struct{}, 1)
	h := &idem.Handler[*sql.Tx]{Name: "seen", Apply: func(ctx context.Context, tx *sql.Tx, m *idem.Message) error {
		started <- struct{}{}
		// A write that takes a moment; ctx ending cuts it short, as a
		// database driver would.
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(500 * time.Millisecond):
		}
		_, err := tx.ExecContext(ctx, `INSERT INTO seen VALUES (?)`, m.ID)
		return err
	}}
	c, err := idem.NewConsumer(p, h, drv, &idem.ConsumerConfig{MaxAttempts: 1, Logger: testenv.Logger(t)})
	if err != nil {
		t.Fatal(err)
	}
	wh, err := idemwm.New(c, nil)
	if err != nil {
		t.Fatal(err)
	}
	ch := gochannel.NewGoChannel(gochannel.Config{}, wmLogger(t))
	t.Cleanup(func() { ch.Close() })
	stop := runRouter(t, ch, "in", wh.Handle)
	if err := ch.Publish("in", message.NewMessage("evt-1", []byte("x"))); err != nil {
		t.Fatal(err)
	}
	select {
	case <-started:
	case <-time.After(10 * time.Second):
		t.Fatal("the handler did not start")
	}
	stop()

	dls, err := drv.DeadLetterList(context.Background(), nil)
	if err != nil {
		t.Fatal(err)
	}
	if len(dls) != 0 {
		t.Fatalf("dead letters %+v: the router's stop dead-lettered a healthy message", dls)
	}
	var n int
	if err := db.QueryRow(`SELECT count(*) FROM seen`).Scan(&n); err != nil {
		t.Fatal(err)
	}
	if n != 1 {
		t.Fatalf("%d rows applied, want 1: the message in flight commits within CloseTimeout", n)
	}
}

// A deadline on the message's context (Watermill's Timeout middleware)
// still cuts the transaction short: the message took too long, and the
// delivery is a retry.
func TestMessageDeadlineStillCutsTheTransaction(t *testing.T) {
	t.Parallel()
	_, drv := testenv.SQLite(t, filepath.Join(t.TempDir(), "idem.db"), nil)
	p, err := idem.NewProcessor(drv, nil)
	if err != nil {
		t.Fatal(err)
	}
	h := &idem.Handler[*sql.Tx]{Name: "slow", Apply: func(ctx context.Context, _ *sql.Tx, _ *idem.Message) error {
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(10 * time.Second):
			return nil
		}
	}}
	c, err := idem.NewConsumer(p, h, drv, &idem.ConsumerConfig{Logger: testenv.Logger(t)})
	if err != nil {
		t.Fatal(err)
	}
	wh, err := idemwm.New(c, &idemwm.Config{Retry: idemwm.ErrorAtOnce})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 100*time.Millisecond)
	defer cancel()
	start := time.Now()
	var re *idemwm.RetryError
	if err := wh.Handle(idemwm.ToMessage(ctx, &idem.Message{ID: "slow-1", Payload: []byte("x")})); !errors.As(err, &re) || !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("Handle: %v, want a RetryError for the deadline", err)
	}
	if took := time.Since(start); took > 5*time.Second {
		t.Fatalf("Handle took %s: the deadline did not reach the transaction", took)
	}
}
