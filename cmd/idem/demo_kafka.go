package main

import (
	"context"
	"fmt"
	"log/slog"
	"runtime"
	"sync"
	"sync/atomic"
	"time"

	"github.com/twmb/franz-go/pkg/kfake"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/idemhq/idem"
	"github.com/idemhq/idem/kafka"
)

const kafkaDemoTopic = "idem-demo"

// kafkaDemo runs the demo over franz-go's in-process Kafka-protocol
// cluster (kfake).
type kafkaDemo struct {
	consumerSet
	cluster *kfake.Cluster
}

func newKafkaDemo() (*kafkaDemo, error) {
	c, err := kfake.NewCluster(kfake.NumBrokers(1), kfake.SeedTopics(6, kafkaDemoTopic))
	if err != nil {
		return nil, fmt.Errorf("in-process Kafka: %w", err)
	}
	return &kafkaDemo{cluster: c}, nil
}

func (d *kafkaDemo) describe() string {
	return fmt.Sprintf("an in-process Kafka-protocol cluster (%v), 3 members of one consumer group", d.cluster.ListenAddrs())
}

func (d *kafkaDemo) killNote() string {
	return "crashed after processing, before committing; their records came back to the group"
}

func (d *kafkaDemo) close() { d.cluster.Close() }

// publish produces the messages keyed by account, the ID in idem-id.
func (d *kafkaDemo) publish(ctx context.Context, msgs []*idem.Message) error {
	cl, err := kgo.NewClient(kgo.SeedBrokers(d.cluster.ListenAddrs()...), kgo.DefaultProduceTopic(kafkaDemoTopic))
	if err != nil {
		return err
	}
	defer cl.Close()
	recs := make([]*kgo.Record, len(msgs))
	for i, m := range msgs {
		recs[i] = &kgo.Record{Key: []byte(m.AggregateID), Value: m.Payload, Headers: []kgo.RecordHeader{
			{Key: kafka.HeaderID, Value: []byte(m.ID)}, {Key: kafka.HeaderType, Value: []byte(m.Type)}}}
	}
	if err := cl.ProduceSync(ctx, recs...).FirstErr(); err != nil {
		return fmt.Errorf("produce: %w", err)
	}
	return nil
}

// start runs one more group member. Killing it makes it crash at its next
// commit: the records it processed since the last one are never committed.
func (d *kafkaDemo) start(ctx context.Context) error {
	var crash atomic.Bool
	c, err := kafka.New(&kafka.Config{Brokers: d.cluster.ListenAddrs(), Group: "demo", Topics: []string{kafkaDemoTopic},
		Handler: d.h, MaxPoll: 200, Logger: slog.New(slog.DiscardHandler),
		Options: []kgo.Opt{kgo.SessionTimeout(6 * time.Second), kgo.RebalanceTimeout(6 * time.Second)},
		FaultHook: func(point string) {
			if point == kafka.FaultBeforeCommit && crash.Load() {
				runtime.Goexit()
			}
		}})
	if err != nil {
		return err
	}
	cctx, cancel := context.WithCancel(ctx)
	done := make(chan struct{})
	go func() { defer close(done); _ = c.Run(cctx) }()
	var once sync.Once
	d.add(func() {
		once.Do(func() {
			crash.Store(true)
			select {
			case <-done:
			case <-time.After(2 * time.Second): // idle: nothing to lose, stop it
				cancel()
				<-done
			}
			cancel()
		})
	})
	return nil
}
