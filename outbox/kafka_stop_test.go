package outbox_test

import (
	"context"
	"log/slog"
	"testing"
	"time"

	"github.com/idemhq/idem"
	"github.com/idemhq/idem/driver"
	"github.com/idemhq/idem/outbox"
)

// TestKafkaStopDuringStuckPublish: a stop while a publish waits on a
// topic the cluster lacks returns promptly and leaves no claim.
func TestKafkaStopDuringStuckPublish(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	p := sqliteProducer(t)
	b := newKafkaBroker(t)
	if err := p.add(ctx, &idem.Message{ID: "a-1", Stream: "no-such-topic", AggregateID: "acct-a", Seq: 1, Payload: []byte("1")}); err != nil {
		t.Fatal(err)
	}
	r, err := outbox.NewRelay(p.drv, b.publisher(t), &outbox.RelayConfig{Owner: "r1", PollInterval: 50 * time.Millisecond,
		Backoff: idem.Backoff{Base: 10 * time.Millisecond, Max: 20 * time.Millisecond}, Logger: slog.New(slog.DiscardHandler)})
	if err != nil {
		t.Fatal(err)
	}
	rctx, stop := context.WithCancel(ctx)
	done := make(chan struct{})
	go func() { defer close(done); _ = r.Run(rctx) }()
	time.Sleep(5 * time.Second) // the second attempt waits ~10 s
	start := time.Now()
	stop()
	<-done
	took := time.Since(start)
	adm, _ := outbox.NewAdmin(p.drv, slog.New(slog.DiscardHandler))
	page, _ := adm.List(ctx, driver.OutboxFilter{})
	e := page.Rows[0]
	t.Logf("Run returned %s after the stop; a-1 %s, %d attempts, claimed by %q, %q", took, e.State, e.Attempts, e.ClaimedBy, e.LastError)
	if took > 3*time.Second || e.ClaimedBy != "" {
		t.Errorf("stop took %s, claim %q", took, e.ClaimedBy)
	}
}
