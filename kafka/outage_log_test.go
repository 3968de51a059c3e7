package kafka_test

import (
	"context"
	"log/slog"
	"strings"
	"testing"
	"time"

	"github.com/twmb/franz-go/pkg/kfake"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/idemhq/idem"
	"github.com/idemhq/idem/internal/testenv"
	"github.com/idemhq/idem/kafka"
)

// TestClusterOutageLogsOncePerInterval: the cluster goes away under a
// member. The client's complaints (a connection it cannot open, a group
// loop that failed) and the member's fetch errors come one line of a kind
// every 10 s, not one every few hundred milliseconds.
func TestClusterOutageLogsOncePerInterval(t *testing.T) {
	t.Parallel()
	cluster, err := kfake.NewCluster(kfake.NumBrokers(1), kfake.SeedTopics(4, topic))
	if err != nil {
		t.Fatal(err)
	}
	b := &broker{addrs: cluster.ListenAddrs()}
	b.produce(t, []*kgo.Record{{Key: []byte("k"), Value: []byte("v"), Headers: []kgo.RecordHeader{{Key: kafka.HeaderID, Value: []byte("m1")}}}})
	handled := make(chan struct{}, 1)
	var buf testenv.Buffer
	c, err := kafka.New(&kafka.Config{Brokers: b.addrs, Group: "g", Topics: []string{topic},
		Handler: idem.DeliveryHandlerFunc(func(context.Context, *idem.Delivery) idem.Verdict {
			select {
			case handled <- struct{}{}:
			default:
			}
			return idem.Verdict{Ack: true}
		}),
		Logger: slog.New(slog.NewTextHandler(&buf, nil))})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- c.Run(ctx) }()
	select {
	case <-handled:
	case <-time.After(15 * time.Second):
		cancel()
		t.Fatal("no record handled in 15 s")
	}
	cluster.Close()
	time.Sleep(7 * time.Second) // the outage, within one interval
	cancel()
	<-done
	kinds := map[string]int{}
	for _, line := range strings.Split(buf.String(), "\n") {
		if i := strings.Index(line, "msg="); i >= 0 {
			msg := line[i:]
			if j := strings.Index(msg, " level="); j >= 0 {
				msg = msg[:j]
			}
			if j := strings.Index(msg[5:], `"`); j > 0 {
				msg = msg[:5+j]
			}
			kinds[msg]++
		}
	}
	if len(kinds) == 0 {
		t.Fatal("nothing logged about the outage")
	}
	for msg, n := range kinds {
		if n > 1 {
			t.Errorf("%d lines of %s in a 7 s outage, want 1", n, msg)
		}
	}
}
