package main

import (
	"context"
	"fmt"
	"strings"
	"time"

	"github.com/twmb/franz-go/pkg/kfake"
)

const (
	// chaosTopic is the run's Kafka topic.
	chaosTopic = "chaos-events"
	// chaosPartitions is its partition count: enough for every consumer
	// count the run allows to get some.
	chaosPartitions = 8
)

// chaosKafka is the run's Kafka-protocol cluster, in this process: its
// brokers listen on loopback ports, so the consumer and relay processes
// reach it as they would a real cluster. Its brokers are not killed.
type chaosKafka struct {
	cluster *kfake.Cluster
}

func newChaosKafka() (*chaosKafka, error) {
	c, err := kfake.NewCluster(kfake.NumBrokers(3), kfake.SeedTopics(chaosPartitions, chaosTopic),
		kfake.GroupMinSessionTimeout(time.Second))
	if err != nil {
		return nil, fmt.Errorf("chaos: in-process Kafka: %w", err)
	}
	return &chaosKafka{cluster: c}, nil
}

func (k *chaosKafka) describe() string {
	return fmt.Sprintf("an in-process Kafka-protocol cluster of 3 brokers (%s), topic %s with %d partitions",
		strings.Join(k.cluster.ListenAddrs(), ","), chaosTopic, chaosPartitions)
}

func (k *chaosKafka) urls() []string                             { return k.cluster.ListenAddrs() }
func (k *chaosKafka) stream() string                             { return chaosTopic }
func (k *chaosKafka) subject() string                            { return chaosTopic }
func (k *chaosKafka) nodes() []*chaosProc                        { return nil }
func (k *chaosKafka) leader(context.Context) string              { return "" }
func (k *chaosKafka) healthy(context.Context) bool               { return true }
func (k *chaosKafka) close()                                     { k.cluster.Close() }
func (k *chaosKafka) waitNode(context.Context, *chaosProc) error { return nil }
