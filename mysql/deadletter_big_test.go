package mysql_test

import (
	"bytes"
	"context"
	"database/sql"
	"errors"
	"sync/atomic"
	"testing"

	"github.com/idemhq/idem"
	"github.com/idemhq/idem/driver"
	"github.com/idemhq/idem/internal/testenv"
	"github.com/idemhq/idem/mysql"
)

// TestLargeMessageIsDeadLettered: a message whose payload and envelope
// together exceed the server's max_allowed_packet, each alone fitting, is
// dead-lettered and replays with its payload intact. The dead letter used
// to be written in one statement carrying both bodies: the server refused
// the packet (error 1153), the delivery was never acknowledged, and the
// poison message came back for ever (on a broker's last delivery the
// consumer kept writing it).
func TestLargeMessageIsDeadLettered(t *testing.T) {
	ctx := context.Background()
	db := testenv.MySQL(t, testenv.MySQLDatabase(t), 4)
	var packet int64
	if err := db.QueryRowContext(ctx, `SELECT @@max_allowed_packet`).Scan(&packet); err != nil {
		t.Fatal(err)
	}
	if packet > 64<<20 {
		t.Skipf("max_allowed_packet is %d: the payload this needs is too large for a test", packet)
	}
	drv, err := mysql.New(db, nil)
	if err != nil {
		t.Fatal(err)
	}
	if err := drv.Migrate(ctx); err != nil {
		t.Fatal(err)
	}
	// Raw is the payload, the envelope holds it in base64 (4/3): together
	// about 1.05 packets, the envelope alone about 0.6.
	payload := bytes.Repeat([]byte("x"), int(packet*45/100))
	p, err := idem.NewProcessor(drv, nil)
	if err != nil {
		t.Fatal(err)
	}
	var broken atomic.Bool
	broken.Store(true)
	var got atomic.Int64
	h := &idem.Handler[*sql.Tx]{Name: "proj", Apply: func(_ context.Context, _ *sql.Tx, m *idem.Message) error {
		if broken.Load() {
			return idem.Permanent(errors.New("bug"))
		}
		if !bytes.Equal(m.Payload, payload) {
			return idem.Permanent(errors.New("payload changed"))
		}
		got.Add(1)
		return nil
	}}
	c, err := idem.NewConsumer(p, h, drv, &idem.ConsumerConfig{Logger: testenv.Logger(t)})
	if err != nil {
		t.Fatal(err)
	}
	msg := &idem.Message{ID: "evt-large", Stream: "s", Type: "T", Payload: payload}
	v := c.HandleDelivery(ctx, &idem.Delivery{Msg: msg, Raw: payload, Source: "s/0@1", Attempt: 1})
	if !v.Ack || !v.DeadLettered {
		t.Fatalf("a %d-byte message with max_allowed_packet %d: verdict ack=%v dead-lettered=%v err=%v; want it dead-lettered",
			len(payload), packet, v.Ack, v.DeadLettered, v.Err)
	}
	// Again: the update of a stored dead letter carries the bodies too.
	v = c.HandleDelivery(ctx, &idem.Delivery{Msg: msg, Raw: payload, Source: "s/0@1", Attempt: 2})
	if !v.Ack || !v.DeadLettered {
		t.Fatalf("the same message again: verdict ack=%v dead-lettered=%v err=%v; want its dead letter updated", v.Ack, v.DeadLettered, v.Err)
	}
	dls, err := drv.DeadLetterList(ctx, &driver.DeadLetterFilter{Handler: "proj"})
	if err != nil || len(dls) != 1 {
		t.Fatalf("list: %d, %v", len(dls), err)
	}
	if !bytes.Equal(dls[0].Raw, payload) || dls[0].Attempts != 2 || len(dls[0].Envelope) < len(payload) {
		t.Fatalf("dead letter: raw %d bytes, envelope %d bytes, attempts %d", len(dls[0].Raw), len(dls[0].Envelope), dls[0].Attempts)
	}
	broken.Store(false)
	if n, err := idem.RequestReplay(ctx, drv, &driver.DeadLetterFilter{Handler: "proj"}, "ops"); err != nil || n != 1 {
		t.Fatalf("RequestReplay: %d, %v", n, err)
	}
	if res, err := c.Replay(ctx); err != nil || res.Outcomes[idem.Applied] != 1 || got.Load() != 1 {
		t.Fatalf("replay: %+v, %v, applied %d; want the payload applied once", res, err, got.Load())
	}
}
