package kafka

import (
	"testing"
	"time"

	"github.com/twmb/franz-go/pkg/kgo"
)

func newTestMember() *member {
	return &member{Consumer: &Consumer{cfg: Config{Map: DefaultMap}}, held: &holds{at: map[partition]time.Time{}}, tries: map[partition]map[int64]tried{}, ahead: map[partition]map[int64]stamp{}}
}

func rec(part int32, offset int64, epoch int32, ts time.Time) *kgo.Record {
	return &kgo.Record{Topic: "t", Partition: part, Offset: offset, LeaderEpoch: epoch, Timestamp: ts}
}

func fetchOf(recs ...*kgo.Record) kgo.Fetches {
	ft := kgo.FetchTopic{Topic: "t"}
	for _, r := range recs {
		ft.Partitions = append(ft.Partitions, kgo.FetchPartition{Partition: r.Partition, Records: []*kgo.Record{r}})
	}
	return kgo.Fetches{{Topics: []kgo.FetchTopic{ft}}}
}

// A record remembered as decided behind a retry, or as tried before, is
// known again only if it is the same record: another one at its offset
// (the log truncated after an unclean leader election, the topic
// recreated) must be handled, at its first attempt.
func TestMemberKnowsTheRecordNotJustItsOffset(t *testing.T) {
	m := newTestMember()
	p := partition{"t", 0}
	ts := time.UnixMilli(1_700_000_000_000)
	m.aheadOf(p, rec(0, 7, 3, ts))
	if !m.isAhead(p, rec(0, 7, 3, ts)) {
		t.Fatal("the same record is not known as ahead")
	}
	m.failed(p, rec(0, 7, 3, ts), 2)
	if d := m.delivery(rec(0, 7, 3, ts)); d.Attempt != 3 {
		t.Errorf("the same record again: attempt %d, want 3", d.Attempt)
	}
	for name, other := range map[string]*kgo.Record{
		"another epoch":     rec(0, 7, 4, ts),
		"another timestamp": rec(0, 7, 3, ts.Add(time.Millisecond)),
		"another offset":    rec(0, 8, 3, ts),
		"another partition": rec(1, 7, 3, ts),
	} {
		if m.isAhead(partition{other.Topic, other.Partition}, other) {
			t.Errorf("%s: known as ahead; it would be committed unhandled", name)
		}
		if d := m.delivery(other); d.Attempt != 1 {
			t.Errorf("%s: attempt %d, want 1: it inherited another record's tries", name, d.Attempt)
		}
	}
}

// Records remembered for a partition that were settled elsewhere (it was
// assigned to another member meanwhile) are forgotten once a fetch of the
// partition starts after them; the rest are kept.
func TestPruneForgetsWhatLiesBeforeTheFetch(t *testing.T) {
	m := newTestMember()
	p0, p1 := partition{"t", 0}, partition{"t", 1}
	ts := time.UnixMilli(1_700_000_000_000)
	for _, off := range []int64{11, 12, 13} {
		m.aheadOf(p0, rec(0, off, 0, ts))
		m.aheadOf(p1, rec(1, off, 0, ts))
	}
	m.failed(p0, rec(0, 10, 0, ts), 2)
	m.failed(p1, rec(1, 10, 0, ts), 2)

	m.prune(fetchOf(rec(0, 13, 0, ts), rec(1, 10, 0, ts)))

	if m.isAhead(p0, rec(0, 11, 0, ts)) || m.isAhead(p0, rec(0, 12, 0, ts)) {
		t.Error("partition 0: records before the fetch still remembered")
	}
	if !m.isAhead(p0, rec(0, 13, 0, ts)) {
		t.Error("partition 0: the fetch's first record forgotten")
	}
	if _, ok := m.tries[p0]; ok {
		t.Error("partition 0: the tries of a record before the fetch kept")
	}
	for _, off := range []int64{11, 12, 13} {
		if !m.isAhead(p1, rec(1, off, 0, ts)) {
			t.Errorf("partition 1 (rewound to its retry): record %d forgotten", off)
		}
	}
	if tr := m.tries[p1]; len(tr) != 1 || tr[10].n != 2 {
		t.Errorf("partition 1: tries = %v, want offset 10 tried twice", tr)
	}
	m.prune(fetchOf(rec(0, 14, 0, ts), rec(1, 14, 0, ts)))
	if len(m.ahead) != 0 || len(m.tries) != 0 {
		t.Errorf("after fetches past everything: ahead %v, tries %v; want both empty", m.ahead, m.tries)
	}
}
