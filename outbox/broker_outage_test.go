package outbox_test

import (
	"context"
	"errors"
	"log/slog"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	natsjs "github.com/nats-io/nats.go/jetstream"

	"github.com/idemhq/idem"
	"github.com/idemhq/idem/internal/testenv"
	"github.com/idemhq/idem/jetstream"
	"github.com/idemhq/idem/outbox"
)

// TestBrokerOutageCountsNoAttempts: while the broker (a private NATS
// server) is stopped, a relay whose Publisher can probe the broker
// (jetstream.Publisher is an outbox.BrokerProber) pauses: no row gets an attempt or an error, no key is held, a couple of
// log lines mark the outage; once the broker is back every row goes out
// by itself. Before, every key's first row counted an attempt per
// backoff and showed as failing (OutboxStats.Failing, Admin's "failing"),
// outage or not.
func TestBrokerOutageCountsNoAttempts(t *testing.T) {
	var _ outbox.BrokerProber = (*jetstream.Publisher)(nil)
	srv := testenv.NewNATSServer(t)
	js, jp := privatePublisher(t, srv, nats.MaxReconnects(-1), nats.ReconnectWait(50*time.Millisecond))
	ctx := context.Background()
	p := sqliteProducer(t)
	const rows, aggregates = 40, 20
	if err := p.fill(ctx, "credits.ledger", rows, aggregates); err != nil {
		t.Fatal(err)
	}
	srv.Stop()

	logs := &testenv.Buffer{}
	r, err := outbox.NewRelay(p.drv, jp, &outbox.RelayConfig{
		ClaimTTL: 2 * time.Second, PollInterval: 50 * time.Millisecond, BatchSize: 10, Concurrency: 4,
		Logger: slog.New(slog.NewTextHandler(logs, nil)),
	})
	if err != nil {
		t.Fatal(err)
	}
	rctx, stop := context.WithCancel(ctx)
	done := make(chan struct{})
	go func() { defer close(done); _ = r.Run(rctx) }()
	defer func() { stop(); <-done }()

	time.Sleep(4 * time.Second)
	if st := outboxStats(t, p); st.Failing != 0 || st.LastError != "" || st.Pending != rows {
		t.Errorf("after 4 s of broker outage: %d rows failing (last error %q), %d pending; want 0 failing, %d pending",
			st.Failing, st.LastError, st.Pending, rows)
	}
	if n := strings.Count(logs.String(), "level=WARN"); n != 1 {
		t.Errorf("%d WARN lines during the outage, want 1:\n%s", n, logs.String())
	}

	srv.Start()
	waitFor(t, "every row published after the broker came back", 15*time.Second, func() bool {
		return outboxStats(t, p).Pending == 0
	})
	if !strings.Contains(logs.String(), "broker answers again") {
		t.Errorf("no line marks the outage's end:\n%s", logs.String())
	}
	s, err := js.Stream(ctx, natsStream)
	if err != nil {
		t.Fatal(err)
	}
	info, err := s.Info(ctx)
	if err != nil {
		t.Fatal(err)
	}
	var got []string
	for seq := uint64(1); seq <= info.State.LastSeq; seq++ {
		m, err := s.GetMsg(ctx, seq)
		if err != nil {
			t.Fatal(err)
		}
		got = append(got, m.Header.Get(jetstream.HeaderMsgID))
	}
	slices.Sort(got)
	got = slices.Compact(got)
	if len(got) != rows {
		t.Fatalf("%d distinct messages in the stream, want %d", len(got), rows)
	}
	t.Logf("the relay's log:\n%s", logs.String())
	// Stopping is prompt.
	start := time.Now()
	stop()
	<-done
	if d := time.Since(start); d > 2*time.Second {
		t.Errorf("Run took %s to return after its context ended", d)
	}
}

// A NATS connection that gave up reconnecting (MaxReconnects) is closed for
// good: a relay on it stops with the probe's error and an ERROR line,
// rather than wait silently for a broker it can never reach again. The
// rows stay pending, with no attempt, for a relay on a new connection.
func TestRelayStopsOnAConnectionClosedForGood(t *testing.T) {
	srv := testenv.NewNATSServer(t)
	_, jp := privatePublisher(t, srv, nats.MaxReconnects(2), nats.ReconnectWait(20*time.Millisecond))
	ctx := context.Background()
	p := sqliteProducer(t)
	const rows = 6
	if err := p.fill(ctx, "credits.ledger", rows, 3); err != nil {
		t.Fatal(err)
	}
	srv.Stop()

	logs := &testenv.Buffer{}
	r, err := outbox.NewRelay(p.drv, jp, &outbox.RelayConfig{
		ClaimTTL: 2 * time.Second, PollInterval: 50 * time.Millisecond,
		Logger: slog.New(slog.NewTextHandler(logs, nil)),
	})
	if err != nil {
		t.Fatal(err)
	}
	rctx, stop := context.WithTimeout(ctx, 30*time.Second)
	defer stop()
	err = r.Run(rctx)
	if rctx.Err() != nil || !errors.Is(err, nats.ErrConnectionClosed) || !idem.IsPermanent(err) {
		t.Fatalf("Run on a connection closed for good: %v (context: %v), want a permanent error matching nats.ErrConnectionClosed", err, rctx.Err())
	}
	if !strings.Contains(logs.String(), "level=ERROR") || !strings.Contains(logs.String(), "MaxReconnects") {
		t.Errorf("no ERROR line says why the relay stopped:\n%s", logs.String())
	}
	if st := outboxStats(t, p); st.Failing != 0 || st.Pending != rows {
		t.Errorf("after the stop: %d rows failing, %d pending; want 0 failing, %d pending", st.Failing, st.Pending, rows)
	}
}

// privatePublisher connects to srv, a NATS server of the test's own, with
// opts, creates the stream of credits.>, and returns JetStream and a
// publisher on it. The connection closes when t ends.
func privatePublisher(t *testing.T, srv *testenv.NATSServer, opts ...nats.Option) (natsjs.JetStream, *jetstream.Publisher) {
	t.Helper()
	js := creditsStream(t, srv.URL(), opts...)
	jp, err := jetstream.NewPublisher(js)
	if err != nil {
		t.Fatal(err)
	}
	return js, jp
}
