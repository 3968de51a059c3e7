package kafka

import (
	"context"
	"log/slog"
	"strings"
	"testing"
	"time"

	"github.com/twmb/franz-go/pkg/kerr"
	"github.com/twmb/franz-go/pkg/kfake"
	"github.com/twmb/franz-go/pkg/kgo"
	"github.com/twmb/franz-go/pkg/kmsg"

	"github.com/idemhq/idem"
	"github.com/idemhq/idem/internal/testenv"
)

// TestPersistentFetchErrorDoesNotSpin: the topic is deleted and created
// again under a member, which the client then fails at once, poll after
// poll (UNKNOWN_TOPIC_ID). The member pauses between such polls, up to a
// second, instead of spinning on them: counted with every line logged.
func TestPersistentFetchErrorDoesNotSpin(t *testing.T) {
	t.Parallel()
	const topic = "t"
	cluster, err := kfake.NewCluster(kfake.NumBrokers(1), kfake.SeedTopics(1, topic))
	if err != nil {
		t.Fatal(err)
	}
	defer cluster.Close()
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
	del := kmsg.NewPtrDeleteTopicsRequest()
	del.TopicNames = []string{topic}
	dt := kmsg.NewDeleteTopicsRequestTopic()
	dt.Topic = kmsg.StringPtr(topic)
	del.Topics = append(del.Topics, dt)
	if _, err := del.RequestWith(ctx, admin); err != nil {
		t.Fatal(err)
	}
	create := kmsg.NewPtrCreateTopicsRequest()
	ct := kmsg.NewCreateTopicsRequestTopic()
	ct.Topic, ct.NumPartitions, ct.ReplicationFactor = topic, 1, 1
	create.Topics = append(create.Topics, ct)
	resp, err := create.RequestWith(ctx, admin)
	if err != nil {
		t.Fatal(err)
	}
	if err := kerr.ErrorForCode(resp.Topics[0].ErrorCode); err != nil {
		t.Fatal(err)
	}
	// Until the member's client sees the new topic ID, then for 3 s.
	for deadline := time.Now().Add(20 * time.Second); !strings.Contains(buf.String(), "UNKNOWN_TOPIC_ID"); time.Sleep(50 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Skip("the client did not fail the recreated topic in 20 s")
		}
	}
	before := strings.Count(buf.String(), "kafka: fetch error")
	time.Sleep(3 * time.Second)
	n := strings.Count(buf.String(), "kafka: fetch error") - before
	t.Logf("%d fetch errors in 3 s", n)
	if n == 0 {
		t.Skip("the client stopped failing the recreated topic")
	}
	if n > 30 {
		t.Fatalf("%d polls failed at once in 3 s: the member spins on a fetch error that lasts", n)
	}
}
