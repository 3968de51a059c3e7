package kafka

import (
	"context"
	"log/slog"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/twmb/franz-go/pkg/kerr"
	"github.com/twmb/franz-go/pkg/kfake"
	"github.com/twmb/franz-go/pkg/kgo"
	"github.com/twmb/franz-go/pkg/kmsg"

	"github.com/idemhq/idem"
	"github.com/idemhq/idem/internal/testenv"
)

// TestPersistentFetchErrorDoesNotSpin: every fetch fails with an error
// the client does not retry itself (TOPIC_AUTHORIZATION_FAILED, as a
// revoked ACL or a topic deleted and created again under the member give),
// so each poll returns it at once. The member pauses between such polls,
// up to a second, instead of spinning on them: counted with every line
// logged. The broker injects the error, so the test does not depend on
// when a client notices a recreated topic.
func TestPersistentFetchErrorDoesNotSpin(t *testing.T) {
	t.Parallel()
	const topic = "t"
	cluster, err := kfake.NewCluster(kfake.NumBrokers(1), kfake.SeedTopics(1, topic))
	if err != nil {
		t.Fatal(err)
	}
	defer cluster.Close()
	var failFetches atomic.Bool
	cluster.ControlKey(int16(kmsg.Fetch), func(kreq kmsg.Request) (kmsg.Response, error, bool) {
		cluster.KeepControl()
		if !failFetches.Load() {
			return nil, nil, false
		}
		req := kreq.(*kmsg.FetchRequest)
		resp := req.ResponseKind().(*kmsg.FetchResponse)
		for _, rt := range req.Topics {
			st := kmsg.NewFetchResponseTopic()
			st.Topic, st.TopicID = rt.Topic, rt.TopicID
			for _, rp := range rt.Partitions {
				sp := kmsg.NewFetchResponseTopicPartition()
				sp.Partition = rp.Partition
				sp.ErrorCode = kerr.TopicAuthorizationFailed.Code
				st.Partitions = append(st.Partitions, sp)
			}
			resp.Topics = append(resp.Topics, st)
		}
		return resp, nil, true
	})
	admin, err := kgo.NewClient(kgo.SeedBrokers(cluster.ListenAddrs()...), kgo.DefaultProduceTopic(topic))
	if err != nil {
		t.Fatal(err)
	}
	defer admin.Close()
	ctx := context.Background()
	if err := admin.ProduceSync(ctx, &kgo.Record{Value: []byte("v"), Headers: []kgo.RecordHeader{{Key: HeaderID, Value: []byte("m1")}}}).FirstErr(); err != nil {
		t.Fatal(err)
	}
	var buf testenv.Buffer
	handled := make(chan struct{}, 1)
	c, err := New(&Config{Brokers: cluster.ListenAddrs(), Group: "g", Topics: []string{topic}, Logger: slog.New(slog.NewTextHandler(&buf, nil)),
		// Every fetch request names its partitions, so each one fails.
		Options: []kgo.Opt{kgo.DisableFetchSessions()},
		Handler: idem.DeliveryHandlerFunc(func(context.Context, *idem.Delivery) idem.Verdict {
			select {
			case handled <- struct{}{}:
			default:
			}
			return idem.Verdict{Ack: true}
		})})
	if err != nil {
		t.Fatal(err)
	}
	c.logs = nil // every line, to count the polls
	rctx, cancel := context.WithCancel(ctx)
	done := make(chan error, 1)
	go func() { done <- c.Run(rctx) }()
	defer func() { cancel(); <-done }()
	select {
	case <-handled:
	case <-time.After(15 * time.Second):
		t.Fatal("no record handled in 15 s")
	}
	failFetches.Store(true)
	// Until the member logs the first failed poll, then for 3 s.
	for deadline := time.Now().Add(20 * time.Second); !strings.Contains(buf.String(), "TOPIC_AUTHORIZATION_FAILED"); time.Sleep(50 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatalf("no failed fetch logged in 20 s; log:\n%s", buf.String())
		}
	}
	before := strings.Count(buf.String(), "kafka: fetch error")
	time.Sleep(3 * time.Second)
	n := strings.Count(buf.String(), "kafka: fetch error") - before
	t.Logf("%d fetch errors in 3 s", n)
	if n == 0 {
		t.Fatalf("no fetch error logged in 3 s while every fetch failed; log:\n%s", buf.String())
	}
	if n > 30 {
		t.Fatalf("%d polls failed at once in 3 s: the member spins on a fetch error that lasts", n)
	}
}
