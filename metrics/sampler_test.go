package metrics_test

import (
	"context"
	"strings"
	"testing"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/idemhq/idem/metrics"
)

// fixedLag is a LagSampler reporting n.
type fixedLag int64

func (n fixedLag) Lag(context.Context) (int64, error) { return int64(n), nil }

// Two Consumers of one handler on one source (two RabbitMQ consumers of a
// queue, two Kafka members of a group in one process) read the same
// broker count: sampling both must not collect one series twice, which
// fails the whole scrape.
func TestSamplerSameSourceTwiceIsOneSeries(t *testing.T) {
	reg := prometheus.NewPedanticRegistry()
	s, err := metrics.NewSampler(reg, nil)
	if err != nil {
		t.Fatal(err)
	}
	s.ConsumerLag("balances", "credits", fixedLag(7))
	s.ConsumerLag("balances", "credits", fixedLag(7))
	s.ConsumerLag("balances", "other", fixedLag(1))
	want := `
# HELP idem_consumer_lag Messages the broker holds that a consumer has not acknowledged, by handler and source (stream/durable, group, queue), read at scrape.
# TYPE idem_consumer_lag gauge
idem_consumer_lag{handler="balances",source="credits"} 7
idem_consumer_lag{handler="balances",source="other"} 1
`
	if err := testutil.GatherAndCompare(reg, strings.NewReader(want), "idem_consumer_lag"); err != nil {
		t.Fatal(err)
	}
}

// A source that is not valid UTF-8 (a Kafka group ID is any bytes) cannot
// be a label value as given: the scrape must not panic (in a goroutine of
// its own, which would end the process).
func TestSamplerSourceNotUTF8(t *testing.T) {
	reg := prometheus.NewPedanticRegistry()
	s, err := metrics.NewSampler(reg, nil)
	if err != nil {
		t.Fatal(err)
	}
	s.ConsumerLag("balances", "group-\xff", fixedLag(3))
	if n, err := testutil.GatherAndCount(reg, "idem_consumer_lag"); err != nil || n != 1 {
		t.Fatalf("gathered %d lag series, %v; want 1", n, err)
	}
}
