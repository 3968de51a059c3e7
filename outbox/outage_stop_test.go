package outbox_test

import (
	"context"
	"log/slog"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/nats-io/nats.go"

	"github.com/idemhq/idem"
	"github.com/idemhq/idem/internal/testenv"
	"github.com/idemhq/idem/outbox"
)

// stopOnPublish stops the NATS server the first time a publish starts,
// so that the publish is in flight when the broker goes away.
type stopOnPublish struct {
	next    outbox.Publisher
	once    sync.Once
	srv     *testenv.NATSServer
	started chan struct{}
}

func (p *stopOnPublish) Publish(ctx context.Context, msgs []*idem.Message) error {
	p.once.Do(func() { p.srv.Stop(); close(p.started) })
	return p.next.Publish(ctx, msgs)
}
func (p *stopOnPublish) Unavailable(err error) bool {
	return p.next.(outbox.BrokerProber).Unavailable(err)
}
func (p *stopOnPublish) Probe(ctx context.Context) error {
	return p.next.(outbox.BrokerProber).Probe(ctx)
}

// TestOutageMidPublishThenStop: the broker goes away while publishes
// are in flight. No attempt is counted (the outage is confirmed when the
// publish is cut at nine tenths of the claim); a stop then, or during the
// in-flight publish, returns promptly and leaves no claim and no hold.
func TestOutageMidPublishThenStop(t *testing.T) {
	t.Parallel()
	for _, stopAfter := range []time.Duration{500 * time.Millisecond, 5 * time.Second} {
		t.Run(stopAfter.String(), func(t *testing.T) {
			ctx := context.Background()
			srv := testenv.NewNATSServer(t)
			_, jp := privatePublisher(t, srv, nats.MaxReconnects(-1), nats.ReconnectWait(50*time.Millisecond))
			p := sqliteProducer(t)
			const rows = 20
			if err := p.fill(ctx, "credits.ledger", rows, 10); err != nil {
				t.Fatal(err)
			}
			pub := &stopOnPublish{next: jp, srv: srv, started: make(chan struct{})}
			logs := &testenv.Buffer{}
			r, err := outbox.NewRelay(p.drv, pub, &outbox.RelayConfig{Owner: "r1", ClaimTTL: 3 * time.Second, PollInterval: 50 * time.Millisecond, Concurrency: 4,
				Logger: slog.New(slog.NewTextHandler(logs, nil))})
			if err != nil {
				t.Fatal(err)
			}
			rctx, stop := context.WithCancel(ctx)
			done := make(chan error, 1)
			go func() { done <- r.Run(rctx) }()
			<-pub.started
			time.Sleep(stopAfter)
			start := time.Now()
			stop()
			select {
			case <-done:
			case <-time.After(15 * time.Second):
				t.Fatal("Run did not return 15 s after its context ended")
			}
			took := time.Since(start)
			t.Logf("Run returned %s after the stop; log:\n%s", took, logs.String())
			if took > 3*time.Second {
				t.Errorf("Run took %s to return after its context ended", took)
			}
			left := unpublished(t, p)
			for _, e := range left {
				if e.Attempts != 0 || e.ClaimedBy != "" || !e.HeldUntil.IsZero() {
					t.Errorf("row %s after an outage and a stop: %d attempts (%q), claimed by %q, held until %v; want none",
						e.MessageID, e.Attempts, e.LastError, e.ClaimedBy, e.HeldUntil)
				}
			}
			if len(left) != rows {
				t.Errorf("%d rows pending, want %d", len(left), rows)
			}
			if strings.Contains(logs.String(), "some keys failed") {
				t.Errorf("keys failed during the outage")
			}
		})
	}
}
