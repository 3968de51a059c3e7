package kafka_test

import (
	"context"
	"fmt"
	"log/slog"
	"net"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/twmb/franz-go/pkg/kfake"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/idemhq/idem/internal/testenv"
	"github.com/idemhq/idem/kafka"
	"github.com/idemhq/idem/outbox"
)

// freePort returns a TCP port nothing listens on now.
func freePort(t *testing.T) int {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	return l.Addr().(*net.TCPAddr).Port
}

// TestRelayPausesWhileTheClusterIsDown runs an outbox relay through the
// Publisher while its cluster is gone: the Publisher is an
// outbox.BrokerProber, so the relay pauses, counts no attempt and records
// no error on the rows, and logs one line; once a cluster answers on the
// same address again every row is published.
func TestRelayPausesWhileTheClusterIsDown(t *testing.T) {
	var _ outbox.BrokerProber = (*kafka.Publisher)(nil)
	ctx := context.Background()
	port := freePort(t)
	cluster, err := kfake.NewCluster(kfake.Ports(port), kfake.NumBrokers(1), kfake.SeedTopics(2, "orders"))
	if err != nil {
		t.Fatal(err)
	}
	addr := cluster.ListenAddrs()
	cl, err := kgo.NewClient(kgo.SeedBrokers(addr...), kgo.RetryTimeout(time.Second))
	if err != nil {
		t.Fatal(err)
	}
	defer cl.Close()
	pub, err := kafka.NewPublisher(cl)
	if err != nil {
		t.Fatal(err)
	}
	if err := pub.Probe(ctx); err != nil {
		t.Fatalf("Probe with the cluster up: %v", err)
	}

	db, drv := testenv.SQLite(t, filepath.Join(t.TempDir(), "outbox.db"), nil)
	ob, err := outbox.New(drv)
	if err != nil {
		t.Fatal(err)
	}
	const rows = 20
	for i := range rows {
		tx, err := db.BeginTx(ctx, nil)
		if err != nil {
			t.Fatal(err)
		}
		if _, err := ob.AddNext(ctx, tx, "orders", fmt.Sprintf("order-%d", i%10), "OrderPlaced", []byte("{}")); err != nil {
			t.Fatal(err)
		}
		if err := tx.Commit(); err != nil {
			t.Fatal(err)
		}
	}
	cluster.Close()
	pctx, cancel := context.WithTimeout(ctx, 2*time.Second)
	perr := pub.Probe(pctx)
	cancel()
	if perr == nil {
		t.Fatal("Probe with the cluster gone: nil")
	}

	logs := &testenv.Buffer{}
	r, err := outbox.NewRelay(drv, pub, &outbox.RelayConfig{
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

	time.Sleep(5 * time.Second)
	st, err := drv.OutboxStats(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if st.Failing != 0 || st.LastError != "" || st.Pending != rows {
		t.Errorf("after 5 s without a cluster: %d rows failing (last error %q), %d pending; want 0 failing, %d pending", st.Failing, st.LastError, st.Pending, rows)
	}
	if n := strings.Count(logs.String(), "level=WARN"); n != 1 {
		t.Errorf("%d WARN lines during the outage, want 1:\n%s", n, logs.String())
	}

	back, err := kfake.NewCluster(kfake.Ports(port), kfake.NumBrokers(1), kfake.SeedTopics(2, "orders"))
	if err != nil {
		t.Fatal(err)
	}
	defer back.Close()
	for deadline := time.Now().Add(20 * time.Second); ; time.Sleep(50 * time.Millisecond) {
		st, err := drv.OutboxStats(ctx)
		if err != nil {
			t.Fatal(err)
		}
		if st.Pending == 0 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("%d rows pending 20 s after the cluster came back:\n%s", st.Pending, logs.String())
		}
	}
	if !strings.Contains(logs.String(), "broker answers again") {
		t.Errorf("no line marks the outage's end:\n%s", logs.String())
	}
	// Every row reached the new cluster.
	rd, err := kgo.NewClient(kgo.SeedBrokers(addr...), kgo.ConsumeTopics("orders"), kgo.ConsumeResetOffset(kgo.NewOffset().AtStart()))
	if err != nil {
		t.Fatal(err)
	}
	defer rd.Close()
	ids := map[string]bool{}
	fctx, fcancel := context.WithTimeout(ctx, 10*time.Second)
	defer fcancel()
	for len(ids) < rows && fctx.Err() == nil {
		rd.PollFetches(fctx).EachRecord(func(rec *kgo.Record) {
			for _, h := range rec.Headers {
				if h.Key == kafka.HeaderID {
					ids[string(h.Value)] = true
				}
			}
		})
	}
	if len(ids) != rows {
		t.Errorf("%d distinct messages in the new cluster, want %d", len(ids), rows)
	}
}
