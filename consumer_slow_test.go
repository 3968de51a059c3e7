package idem_test

import (
	"context"
	"database/sql"
	"log/slog"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/idemhq/idem"
	"github.com/idemhq/idem/internal/testenv"
)

// A delivery still undecided after SlowWarning is logged once, with what
// it is: a store that hangs without failing shows nowhere else. One
// decided in time writes nothing.
func TestSlowDeliveryIsLogged(t *testing.T) {
	t.Parallel()
	_, drv := testenv.SQLite(t, filepath.Join(t.TempDir(), "idem.db"), nil)
	p, err := idem.NewProcessor(drv, nil)
	if err != nil {
		t.Fatal(err)
	}
	h := &idem.Handler[*sql.Tx]{Name: "proj", Apply: func(_ context.Context, _ *sql.Tx, m *idem.Message) error {
		if m.ID == "slow" {
			time.Sleep(600 * time.Millisecond)
		}
		return nil
	}}
	logs := &testenv.Buffer{}
	c, err := idem.NewConsumer(p, h, drv, &idem.ConsumerConfig{SlowWarning: 200 * time.Millisecond, Logger: slog.New(slog.NewTextHandler(logs, nil))})
	if err != nil {
		t.Fatal(err)
	}
	for _, id := range []string{"fast", "slow"} {
		if v := c.HandleDelivery(context.Background(), &idem.Delivery{Msg: &idem.Message{ID: id, Payload: []byte("x")}, Attempt: 1, Source: "test"}); !v.Ack {
			t.Fatalf("%s: %+v; want applied", id, v)
		}
	}
	out := logs.String()
	if n := strings.Count(out, "still undecided"); n != 1 || !strings.Contains(out, "message_id=slow") {
		t.Fatalf("%d slow-delivery lines; want one, of the slow delivery:\n%s", n, out)
	}
}
