package metrics_test

import (
	"context"
	"errors"
	"path/filepath"
	"strings"
	"testing"

	"github.com/nats-io/nats.go"
	natsjs "github.com/nats-io/nats.go/jetstream"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/idemhq/idem"
	"github.com/idemhq/idem/internal/testenv"
	"github.com/idemhq/idem/jetstream"
	"github.com/idemhq/idem/metrics"
	"github.com/idemhq/idem/outbox"
)

// TestRelayAndLagMetrics: a relay publishing to a real (embedded)
// JetStream counts the rows it published and those the broker refused;
// the sampler reads the outbox's pending rows and age, and a consumer's
// lag: the messages published and not consumed.
func TestRelayAndLagMetrics(t *testing.T) {
	ctx := context.Background()
	db, drv := testenv.SQLite(t, filepath.Join(t.TempDir(), "app.db"), nil)
	ob, err := outbox.New(drv)
	if err != nil {
		t.Fatal(err)
	}
	tx, err := db.BeginTx(ctx, nil)
	if err != nil {
		t.Fatal(err)
	}
	for _, subject := range []string{"orders.a", "orders.b", "orders.c", "nowhere.d"} {
		if _, err := ob.AddNext(ctx, tx, subject, subject[len(subject)-1:], "T", []byte("{}")); err != nil {
			t.Fatal(err)
		}
	}
	if err := tx.Commit(); err != nil {
		t.Fatal(err)
	}
	nc, err := nats.Connect(testenv.EmbeddedNATS(t))
	if err != nil {
		t.Fatal(err)
	}
	defer nc.Close()
	js, err := natsjs.New(nc)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := js.CreateStream(ctx, natsjs.StreamConfig{Name: "ORDERS", Subjects: []string{"orders.>"}}); err != nil {
		t.Fatal(err)
	}

	reg := prometheus.NewRegistry()
	m, err := metrics.New(reg, nil)
	if err != nil {
		t.Fatal(err)
	}
	pub, err := jetstream.NewPublisher(js)
	if err != nil {
		t.Fatal(err)
	}
	relay, err := outbox.NewRelay(drv, pub, &outbox.RelayConfig{Hooks: []idem.Hook{m}, Logger: testenv.Logger(t)})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := relay.RunOnce(ctx); err == nil {
		t.Fatal("a row to a subject no stream covers was published")
	}
	want := `
# HELP idem_outbox_publish_failures_total Outbox rows a relay of this process claimed and did not publish (the broker refused them, or the claim ran out); they stay pending.
# TYPE idem_outbox_publish_failures_total counter
idem_outbox_publish_failures_total 1
# HELP idem_outbox_published_total Outbox rows a relay of this process published: the broker acknowledged them and they were marked.
# TYPE idem_outbox_published_total counter
idem_outbox_published_total 3
`
	if err := testutil.GatherAndCompare(reg, strings.NewReader(want), "idem_outbox_published_total", "idem_outbox_publish_failures_total"); err != nil {
		t.Fatal(err)
	}

	s, err := metrics.NewSampler(reg, nil)
	if err != nil {
		t.Fatal(err)
	}
	s.Outbox(relay)
	ack := idem.DeliveryHandlerFunc(func(context.Context, *idem.Delivery) idem.Verdict { return idem.Verdict{Ack: true} })
	c, err := jetstream.New(js, &jetstream.Config{Stream: "ORDERS", Durable: "totals", Handler: ack})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := js.CreateOrUpdateConsumer(ctx, "ORDERS", natsjs.ConsumerConfig{Durable: "totals", AckPolicy: natsjs.AckExplicitPolicy}); err != nil {
		t.Fatal(err)
	}
	s.ConsumerLag("order-totals", c.LagSource(), c)
	gone, err := jetstream.New(js, &jetstream.Config{Stream: "ORDERS", Durable: "gone", Handler: ack})
	if err != nil {
		t.Fatal(err)
	}
	s.ConsumerLag("gone", gone.LagSource(), gone) // no such durable: a failed reading
	want = `
# HELP idem_consumer_lag Messages the broker holds that a consumer has not acknowledged, by handler and source (stream/durable, group, queue), read at scrape.
# TYPE idem_consumer_lag gauge
idem_consumer_lag{handler="order-totals",source="ORDERS/totals"} 3
# HELP idem_outbox_pending Outbox rows not yet published (parked ones included), read at scrape.
# TYPE idem_outbox_pending gauge
idem_outbox_pending 1
# HELP idem_sample_failures_total Readings of a sampled gauge that failed at scrape (the series is then left out), by metric.
# TYPE idem_sample_failures_total counter
idem_sample_failures_total{metric="consumer_lag"} 1
`
	if err := testutil.GatherAndCompare(reg, strings.NewReader(want), "idem_consumer_lag", "idem_outbox_pending", "idem_sample_failures_total"); err != nil {
		t.Fatal(err)
	}
	mfs, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	for _, mf := range mfs {
		if mf.GetName() == "idem_outbox_lag_seconds" {
			if age := mf.GetMetric()[0].GetGauge().GetValue(); age <= 0 || age > 600 {
				t.Fatalf("outbox lag %v s, want the failing row's age", age)
			}
			return
		}
	}
	t.Fatal("no idem_outbox_lag_seconds")
}

// TestNewSamplerRejectsBadRegistration: no registry, or one holding the
// sampler's names already, is an invalid configuration.
func TestNewSamplerRejectsBadRegistration(t *testing.T) {
	if _, err := metrics.NewSampler(nil, nil); !errors.Is(err, idem.ErrInvalidConfig) {
		t.Fatalf("nil registry: %v", err)
	}
	reg := prometheus.NewRegistry()
	if _, err := metrics.NewSampler(reg, nil); err != nil {
		t.Fatal(err)
	}
	if _, err := metrics.NewSampler(reg, nil); !errors.Is(err, idem.ErrInvalidConfig) {
		t.Fatalf("second sampler on one registry: %v", err)
	}
	if _, err := metrics.NewSampler(reg, &metrics.SamplerConfig{Namespace: "billing"}); err != nil {
		t.Fatalf("another namespace: %v", err)
	}
}
