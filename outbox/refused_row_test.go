package outbox_test

import (
	"bytes"
	"context"
	"log/slog"
	"strings"
	"testing"
	"time"

	"github.com/idemhq/idem"
	"github.com/idemhq/idem/driver"
	"github.com/idemhq/idem/internal/testenv"
	"github.com/idemhq/idem/outbox"
)

// TestRefusedRowIsVisibleAndBlocksItsKey: a row the JetStream
// Publisher refuses for ever fails visibly (attempts, last_error with the
// reason), is not taken for a broker outage, holds its key's later row,
// lets another key's row out; parking keeps the later row waiting,
// discarding lets it out.
func TestRefusedRowIsVisibleAndBlocksItsKey(t *testing.T) {
	t.Parallel()
	for _, c := range []struct {
		name   string
		bad    func(m *idem.Message)
		reason string
	}{
		{"nats-header", func(m *idem.Message) { m.Headers = map[string]string{"Nats-Rollup": "sub"} }, "Nats-Rollup"},
		{"nats-expected", func(m *idem.Message) { m.Headers = map[string]string{"Nats-Expected-Last-Sequence": "0"} }, "Nats-Expected"},
		{"no-stream", func(m *idem.Message) { m.Stream = "nostream.x" }, "nostream.x"},
		{"wildcard", func(m *idem.Message) { m.Stream = "credits.*" }, "wildcard"},
		{"too-large", func(m *idem.Message) { m.Payload = bytes.Repeat([]byte("x"), 2<<20) }, "payload"},
		{"status", func(m *idem.Message) { m.Payload = nil; m.Headers = map[string]string{"Status": "503"} }, "Status"},
	} {
		t.Run(c.name, func(t *testing.T) {
			t.Parallel()
			ctx := context.Background()
			p := sqliteProducer(t)
			b := newNATSBroker(t)
			a1 := &idem.Message{ID: "a-1", Stream: b.stream(), AggregateID: "acct-a", Seq: 1, Payload: []byte("1")}
			c.bad(a1)
			a2 := &idem.Message{ID: "a-2", Stream: b.stream(), AggregateID: "acct-a", Seq: 2, Payload: []byte("2")}
			b1 := &idem.Message{ID: "b-1", Stream: b.stream(), AggregateID: "acct-b", Seq: 1, Payload: []byte("3")}
			if err := p.add(ctx, a1, a2, b1); err != nil {
				t.Fatalf("add: %v", err)
			}
			logs := &testenv.Buffer{}
			r, err := outbox.NewRelay(p.drv, b.publisher(t), &outbox.RelayConfig{Owner: "r1", PollInterval: 20 * time.Millisecond,
				Backoff: idem.Backoff{Base: 20 * time.Millisecond, Max: 50 * time.Millisecond}, Logger: slog.New(slog.NewTextHandler(logs, nil))})
			if err != nil {
				t.Fatal(err)
			}
			run := func(d time.Duration) {
				rctx, stop := context.WithTimeout(ctx, d)
				defer stop()
				start := time.Now()
				_ = r.Run(rctx)
				if el := time.Since(start); el > d+3*time.Second {
					t.Errorf("Run took %s to return after its %s context ended", el, d)
				}
			}
			run(1500 * time.Millisecond)
			if strings.Contains(logs.String(), "broker unreachable") {
				t.Errorf("a refused row was taken for a broker outage:\n%s", logs.String())
			}
			rows := unpublished(t, p)
			if len(rows) != 2 {
				t.Fatalf("%d unpublished rows, want a-1 and a-2: %+v", len(rows), rows)
			}
			f, w := rows[0], rows[1]
			t.Logf("a-1: state %s attempts %d last error %q; a-2: state %s attempts %d", f.State, f.Attempts, f.LastError, w.State, w.Attempts)
			if f.MessageID != "a-1" || f.State != driver.OutboxFailing || f.Attempts < 2 || !strings.Contains(f.LastError, c.reason) {
				t.Errorf("a-1: %s, %d attempts, last error %q; want failing, several attempts, an error naming %q", f.State, f.Attempts, f.LastError, c.reason)
			}
			if w.MessageID != "a-2" || w.State != driver.OutboxPending || w.Attempts != 0 {
				t.Errorf("a-2: %s %s, %d attempts; want pending with none", w.MessageID, w.State, w.Attempts)
			}
			if got := b.messages(t); len(got) != 1 || got[0].ID != "b-1" {
				t.Fatalf("stream holds %+v; want b-1 alone", got)
			}
			adm, err := outbox.NewAdmin(p.drv, slog.New(slog.DiscardHandler))
			if err != nil {
				t.Fatal(err)
			}
			if _, err := adm.Park(ctx, []int64{f.ID}, "alice", "refused"); err != nil {
				t.Fatal(err)
			}
			run(300 * time.Millisecond)
			if got := b.messages(t); len(got) != 1 {
				t.Fatalf("after park the stream holds %d messages; want a-2 still waiting", len(got))
			}
			if _, err := adm.Discard(ctx, []int64{f.ID}, "alice", "refused"); err != nil {
				t.Fatal(err)
			}
			run(500 * time.Millisecond)
			if got := b.messages(t); len(got) != 2 || got[1].ID != "a-2" {
				t.Fatalf("after discard the stream holds %+v; want b-1, a-2", got)
			}
		})
	}
}
