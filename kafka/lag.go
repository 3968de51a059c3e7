package kafka

import (
	"context"
	"errors"
	"fmt"

	"github.com/twmb/franz-go/pkg/kerr"
	"github.com/twmb/franz-go/pkg/kgo"
	"github.com/twmb/franz-go/pkg/kmsg"
)

// Lag returns the records of the consumer's topics that its group has not
// committed: for each partition, the high watermark less the committed
// offset, or less the log's start where the group committed nothing (the
// consumer starts there). It opens a client of its own with the Config's
// brokers and Options for the call, and asks the brokers for the
// partitions, their offsets and the group's commits. The metrics package
// samples it as idem_consumer_lag.
func (c *Consumer) Lag(ctx context.Context) (int64, error) {
	lag, err := c.lag(ctx)
	if err != nil {
		return 0, fmt.Errorf("kafka: lag of group %q: %w", c.cfg.Group, err)
	}
	return lag, nil
}

func (c *Consumer) lag(ctx context.Context) (int64, error) {
	cl, err := kgo.NewClient(append([]kgo.Opt{kgo.SeedBrokers(c.cfg.Brokers...)}, c.cfg.Options...)...)
	if err != nil {
		return 0, err
	}
	defer cl.Close()

	meta := kmsg.NewPtrMetadataRequest()
	for _, t := range c.cfg.Topics {
		rt := kmsg.NewMetadataRequestTopic()
		rt.Topic = kmsg.StringPtr(t)
		meta.Topics = append(meta.Topics, rt)
	}
	mr, err := meta.RequestWith(ctx, cl)
	if err != nil {
		return 0, err
	}
	type tp struct {
		topic string
		part  int32
	}
	var parts []tp
	for _, t := range mr.Topics {
		if err := kerr.ErrorForCode(t.ErrorCode); err != nil {
			return 0, fmt.Errorf("topic %q: %w", deref(t.Topic), err)
		}
		for _, p := range t.Partitions {
			parts = append(parts, tp{deref(t.Topic), p.Partition})
		}
	}
	// offsets lists each partition's offset at ts: -1 the end, -2 the start.
	offsets := func(ts int64) (map[tp]int64, error) {
		req := kmsg.NewPtrListOffsetsRequest()
		req.ReplicaID = -1
		byTopic := map[string]int{}
		for _, p := range parts {
			i, ok := byTopic[p.topic]
			if !ok {
				i = len(req.Topics)
				byTopic[p.topic] = i
				rt := kmsg.NewListOffsetsRequestTopic()
				rt.Topic = p.topic
				req.Topics = append(req.Topics, rt)
			}
			rp := kmsg.NewListOffsetsRequestTopicPartition()
			rp.Partition, rp.Timestamp, rp.CurrentLeaderEpoch = p.part, ts, -1
			req.Topics[i].Partitions = append(req.Topics[i].Partitions, rp)
		}
		resp, err := req.RequestWith(ctx, cl)
		if err != nil {
			return nil, err
		}
		out := map[tp]int64{}
		for _, t := range resp.Topics {
			for _, p := range t.Partitions {
				if err := kerr.ErrorForCode(p.ErrorCode); err != nil {
					return nil, fmt.Errorf("offsets of %s/%d: %w", t.Topic, p.Partition, err)
				}
				out[tp{t.Topic, p.Partition}] = p.Offset
			}
		}
		return out, nil
	}
	ends, err := offsets(-1)
	if err != nil {
		return 0, err
	}
	starts, err := offsets(-2)
	if err != nil {
		return 0, err
	}
	fetch := kmsg.NewPtrOffsetFetchRequest()
	fetch.Group = c.cfg.Group
	for _, t := range c.cfg.Topics {
		rt := kmsg.NewOffsetFetchRequestTopic()
		rt.Topic = t
		for _, p := range parts {
			if p.topic == t {
				rt.Partitions = append(rt.Partitions, p.part)
			}
		}
		fetch.Topics = append(fetch.Topics, rt)
	}
	fr, err := fetch.RequestWith(ctx, cl)
	if err != nil {
		return 0, err
	}
	if err := kerr.ErrorForCode(fr.ErrorCode); errors.Is(err, kerr.GroupIDNotFound) {
		// A group that never committed: some brokers say so rather than
		// return no offsets.
		fr.Topics = nil
	} else if err != nil {
		return 0, fmt.Errorf("committed offsets: %w", err)
	}
	committed := map[tp]int64{}
	for _, t := range fr.Topics {
		for _, p := range t.Partitions {
			if err := kerr.ErrorForCode(p.ErrorCode); err != nil {
				return 0, fmt.Errorf("committed offset of %s/%d: %w", t.Topic, p.Partition, err)
			}
			committed[tp{t.Topic, p.Partition}] = p.Offset
		}
	}
	var lag int64
	for _, p := range parts {
		from, ok := committed[p]
		if !ok || from < 0 {
			from = starts[p]
		}
		lag += max(ends[p]-from, 0)
	}
	return lag, nil
}

// LagSource names what Lag measures, for the metric's source label: the
// group.
func (c *Consumer) LagSource() string { return c.cfg.Group }

func deref(s *string) string {
	if s == nil {
		return ""
	}
	return *s
}
