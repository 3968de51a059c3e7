package metrics_test

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/idemhq/idem"
	"github.com/idemhq/idem/driver"
	"github.com/idemhq/idem/internal/testenv"
	"github.com/idemhq/idem/metrics"
	"github.com/idemhq/idem/sqlite"
)

func newProcessor(t testing.TB, hooks ...idem.Hook) *idem.Processor[*sql.Tx] {
	t.Helper()
	p, _ := newProcessorAndDriver(t, hooks...)
	return p
}

func newProcessorAndDriver(t testing.TB, hooks ...idem.Hook) (*idem.Processor[*sql.Tx], *sqlite.Driver) {
	t.Helper()
	_, drv := testenv.SQLite(t, ":memory:", nil)
	p, err := idem.NewProcessor(drv, &idem.Config{Hooks: hooks})
	if err != nil {
		t.Fatal(err)
	}
	return p, drv
}

// scriptedHandler is "balances", whose payload says what it does: "fail"
// (a retriable error), "poison" (a permanent one), "panic"; anything else
// applies.
func scriptedHandler() *idem.Handler[*sql.Tx] {
	return &idem.Handler[*sql.Tx]{Name: "balances", Apply: func(_ context.Context, _ *sql.Tx, msg *idem.Message) error {
		switch string(msg.Payload) {
		case "fail":
			return errors.New("projection store down")
		case "poison":
			return idem.Permanent(errors.New("cannot decode"))
		case "panic":
			panic("bug")
		}
		return nil
	}}
}

// TestOutcomesAndErrorsCounted runs real messages through a SQLite
// processor and compares the exported counters with what happened.
func TestOutcomesAndErrorsCounted(t *testing.T) {
	ctx := context.Background()
	reg := prometheus.NewPedanticRegistry()
	m, err := metrics.New(reg, nil)
	if err != nil {
		t.Fatal(err)
	}
	p := newProcessor(t, m)
	h := scriptedHandler()
	run := func(id, payload string) {
		_, _ = p.Process(ctx, h, &idem.Message{ID: id, Payload: []byte(payload)})
	}
	run("a", "ok")
	run("b", "ok")
	run("a", "ok")      // duplicate
	run("a", "changed") // conflict
	run("c", "fail")    // retriable
	run("d", "poison")  // permanent
	run("e", "panic")   // panic
	run("", "ok")       // invalid ID
	other := &idem.Handler[*sql.Tx]{Name: "mailer", ApplyBatch: func(context.Context, *sql.Tx, []*idem.Message) error { return nil }}
	batch := []*idem.Message{{ID: "m1"}, {ID: "m2"}, {ID: "m3"}, {ID: "m1"}}
	if _, err := p.ProcessBatch(ctx, other, batch); err != nil {
		t.Fatal(err)
	}

	want := `
# HELP idem_errors_total Messages whose processing returned an error, by handler and kind (retriable, permanent, panic, gap, invalid, canceled).
# TYPE idem_errors_total counter
idem_errors_total{handler="balances",kind="invalid"} 1
idem_errors_total{handler="balances",kind="panic"} 1
idem_errors_total{handler="balances",kind="permanent"} 1
idem_errors_total{handler="balances",kind="retriable"} 1
# HELP idem_messages_total Messages processed, by handler and outcome (applied, duplicate, conflict, stale, in_flight, error).
# TYPE idem_messages_total counter
idem_messages_total{handler="balances",outcome="applied"} 2
idem_messages_total{handler="balances",outcome="conflict"} 1
idem_messages_total{handler="balances",outcome="duplicate"} 1
idem_messages_total{handler="balances",outcome="error"} 4
idem_messages_total{handler="mailer",outcome="applied"} 3
idem_messages_total{handler="mailer",outcome="duplicate"} 1
`
	if err := testutil.GatherAndCompare(reg, strings.NewReader(want), "idem_messages_total", "idem_errors_total"); err != nil {
		t.Fatal(err)
	}
	counts := histogramCounts(t, reg)
	if counts["balances"] != 8 || counts["mailer"] != 4 {
		t.Fatalf("duration observations per handler %v, want balances 8, mailer 4", counts)
	}
}

// TestConsumerVerdictsCounted drives a real Consumer (SQLite dead-letter
// store) one delivery and one batch at a time and compares the verdicts
// counted with what it returned.
func TestConsumerVerdictsCounted(t *testing.T) {
	ctx := context.Background()
	reg := prometheus.NewPedanticRegistry()
	m, err := metrics.New(reg, nil)
	if err != nil {
		t.Fatal(err)
	}
	p, drv := newProcessorAndDriver(t, m)
	h := scriptedHandler()
	if _, err := idem.NewConsumer(p, h, drv, &idem.ConsumerConfig{Hooks: []idem.Hook{outcomeOnly{}}}); !errors.Is(err, idem.ErrInvalidConfig) {
		t.Fatalf("consumer hook without OnVerdict: %v, want ErrInvalidConfig", err)
	}
	c, err := idem.NewConsumer(p, h, drv, &idem.ConsumerConfig{Hooks: []idem.Hook{m}})
	if err != nil {
		t.Fatal(err)
	}
	for _, d := range []struct {
		id, payload string
		ack, dead   bool
	}{{"a", "ok", true, false}, {"a", "ok", true, false}, {"b", "fail", false, false}, {"c", "poison", true, true}} {
		v := c.HandleDelivery(ctx, &idem.Delivery{Msg: &idem.Message{ID: d.id, Payload: []byte(d.payload)}, Attempt: 1})
		if v.Ack != d.ack || v.DeadLettered != d.dead {
			t.Fatalf("delivery %s/%s: %+v, want ack %v, dead-lettered %v", d.id, d.payload, v, d.ack, d.dead)
		}
	}
	if v := c.HandleDelivery(ctx, &idem.Delivery{DecodeErr: errors.New("not JSON"), Raw: []byte("{"), Attempt: 1}); !v.DeadLettered {
		t.Fatalf("undecodable delivery: %+v, want dead-lettered", v)
	}
	batch := []*idem.Delivery{
		{Msg: &idem.Message{ID: "d", Payload: []byte("ok")}},
		{Msg: &idem.Message{ID: "e", Payload: []byte("ok")}},
		{Msg: &idem.Message{ID: "a", Payload: []byte("ok")}},
	}
	for _, v := range c.HandleDeliveries(ctx, batch) {
		if !v.Ack {
			t.Fatalf("batch verdict %+v, want acked", v)
		}
	}
	want := `
# HELP idem_deliveries_total Broker deliveries decided by a Consumer, by handler and verdict (acked, retried, in_flight, dead_lettered).
# TYPE idem_deliveries_total counter
idem_deliveries_total{handler="balances",verdict="acked"} 5
idem_deliveries_total{handler="balances",verdict="dead_lettered"} 2
idem_deliveries_total{handler="balances",verdict="retried"} 1
# HELP idem_dead_letters_total Deliveries a Consumer dead-lettered, by handler and class (permanent, conflict, decode, exhausted).
# TYPE idem_dead_letters_total counter
idem_dead_letters_total{class="decode",handler="balances"} 1
idem_dead_letters_total{class="permanent",handler="balances"} 1
`
	if err := testutil.GatherAndCompare(reg, strings.NewReader(want), "idem_deliveries_total", "idem_dead_letters_total"); err != nil {
		t.Fatal(err)
	}
}

type outcomeOnly struct{}

func (outcomeOnly) OnOutcome(context.Context, *idem.OutcomeEvent) {}

func histogramCounts(t *testing.T, reg prometheus.Gatherer) map[string]uint64 {
	t.Helper()
	mfs, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	out := map[string]uint64{}
	for _, mf := range mfs {
		if mf.GetName() != "idem_message_duration_seconds" {
			continue
		}
		for _, mt := range mf.GetMetric() {
			for _, l := range mt.GetLabel() {
				if l.GetName() == "handler" {
					out[l.GetValue()] = mt.GetHistogram().GetSampleCount()
				}
			}
		}
	}
	return out
}

// TestBatchDurationShared: each message of a batch is observed once, with
// the batch's time divided among them.
func TestBatchDurationShared(t *testing.T) {
	reg := prometheus.NewRegistry()
	m, err := metrics.New(reg, &metrics.Config{Namespace: "app", Buckets: []float64{0.5, 1, 5}})
	if err != nil {
		t.Fatal(err)
	}
	for range 4 {
		m.OnOutcome(context.Background(), &idem.OutcomeEvent{Handler: "h", Outcome: idem.Applied, Duration: 2 * time.Second, BatchSize: 4})
	}
	want := `
# HELP app_message_duration_seconds Processing time per message, from the call to its outcome; a batch's time is shared among its messages.
# TYPE app_message_duration_seconds histogram
app_message_duration_seconds_bucket{handler="h",le="0.5"} 4
app_message_duration_seconds_bucket{handler="h",le="1"} 4
app_message_duration_seconds_bucket{handler="h",le="5"} 4
app_message_duration_seconds_bucket{handler="h",le="+Inf"} 4
app_message_duration_seconds_sum{handler="h"} 2
app_message_duration_seconds_count{handler="h"} 4
`
	if err := testutil.GatherAndCompare(reg, strings.NewReader(want), "app_message_duration_seconds"); err != nil {
		t.Fatal(err)
	}
}

// TestConcurrentOutcomes: many goroutines reporting at once lose no count.
func TestConcurrentOutcomes(t *testing.T) {
	reg := prometheus.NewRegistry()
	m, err := metrics.New(reg, nil)
	if err != nil {
		t.Fatal(err)
	}
	var wg sync.WaitGroup
	for g := range 8 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := range 1000 {
				m.OnOutcome(context.Background(), &idem.OutcomeEvent{Handler: fmt.Sprintf("h%d", i%3), Outcome: idem.Outcome(1 + (g+i)%2), BatchSize: 1})
			}
		}()
	}
	wg.Wait()
	var total float64
	for h := range 3 {
		for _, o := range []string{"applied", "duplicate"} {
			total += counterValue(t, reg, fmt.Sprintf("h%d", h), o)
		}
	}
	if total != 8000 {
		t.Fatalf("counted %v outcomes, want 8000", total)
	}
}

// counterValue reads the idem_messages_total series of handler and
// outcome back from reg.
func counterValue(t *testing.T, reg prometheus.Gatherer, handler, outcome string) float64 {
	t.Helper()
	mfs, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	for _, mf := range mfs {
		if mf.GetName() != "idem_messages_total" {
			continue
		}
		for _, mt := range mf.GetMetric() {
			labels := map[string]string{}
			for _, l := range mt.GetLabel() {
				labels[l.GetName()] = l.GetValue()
			}
			if labels["handler"] == handler && labels["outcome"] == outcome {
				return mt.GetCounter().GetValue()
			}
		}
	}
	t.Fatalf("no idem_messages_total{handler=%q,outcome=%q}", handler, outcome)
	return 0
}

func TestNewRejectsBadRegistration(t *testing.T) {
	if _, err := metrics.New(nil, nil); !errors.Is(err, idem.ErrInvalidConfig) {
		t.Fatalf("nil registerer: %v, want ErrInvalidConfig", err)
	}
	reg := prometheus.NewRegistry()
	if _, err := metrics.New(reg, nil); err != nil {
		t.Fatal(err)
	}
	_, err := metrics.New(reg, nil)
	var are prometheus.AlreadyRegisteredError
	if !errors.Is(err, idem.ErrInvalidConfig) || !errors.As(err, &are) {
		t.Fatalf("second registration: %v, want ErrInvalidConfig wrapping AlreadyRegisteredError", err)
	}
	if _, err := metrics.New(reg, &metrics.Config{Namespace: "other"}); err != nil {
		t.Fatalf("another namespace on the same registry: %v", err)
	}
	// A clash on a later metric leaves none of the new ones registered:
	// once the clash is gone, the same New succeeds.
	clash := prometheus.NewRegistry()
	taken := prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "third_deliveries_total",
		Help: "Broker deliveries decided by a Consumer, by handler and verdict (acked, retried, in_flight, dead_lettered).",
	}, []string{"handler", "verdict"})
	clash.MustRegister(taken)
	if _, err := metrics.New(clash, &metrics.Config{Namespace: "third"}); !errors.Is(err, idem.ErrInvalidConfig) {
		t.Fatalf("clash: %v, want ErrInvalidConfig", err)
	}
	clash.Unregister(taken)
	if _, err := metrics.New(clash, &metrics.Config{Namespace: "third"}); err != nil {
		t.Fatalf("New once the clash is gone: %v (a failed New left metrics behind)", err)
	}
}

func TestKind(t *testing.T) {
	cases := []struct {
		err  error
		want string
	}{
		{errors.New("down"), metrics.KindRetriable},
		{fmt.Errorf("wrapped: %w", idem.Permanent(errors.New("bad"))), metrics.KindPermanent},
		{&idem.PanicError{Value: "bug"}, metrics.KindPanic},
		{&idem.GapError{AggregateID: "a", Seq: 3, Last: 1}, metrics.KindGap},
		{fmt.Errorf("x: %w", idem.ErrInvalidMessage), metrics.KindInvalid},
		{context.DeadlineExceeded, metrics.KindCanceled},
	}
	for _, c := range cases {
		if got := metrics.Kind(c.err); got != c.want {
			t.Errorf("Kind(%v) = %q, want %q", c.err, got, c.want)
		}
	}
}

// BenchmarkOnOutcome measures the hook's cost per message: go test
// ./metrics -bench OnOutcome.
func BenchmarkOnOutcome(b *testing.B) {
	m, err := metrics.New(prometheus.NewRegistry(), nil)
	if err != nil {
		b.Fatal(err)
	}
	ev := &idem.OutcomeEvent{Handler: "balances", Outcome: idem.Applied, Duration: time.Millisecond, BatchSize: 1}
	b.RunParallel(func(pb *testing.PB) {
		for pb.Next() {
			m.OnOutcome(context.Background(), ev)
		}
	})
}

// TestLeaseLostCounted: a lease-mode worker whose store goes away mid-call
// loses its lease; the metrics count the loss and the error outcome.
func TestLeaseLostCounted(t *testing.T) {
	reg := prometheus.NewPedanticRegistry()
	m, err := metrics.New(reg, nil)
	if err != nil {
		t.Fatal(err)
	}
	db, drv := testenv.SQLite(t, filepath.Join(t.TempDir(), "lease.db"), nil)
	p, err := idem.NewLeaseProcessor(drv, &idem.LeaseConfig{TTL: 300 * time.Millisecond, Hooks: []idem.Hook{m}})
	if err != nil {
		t.Fatal(err)
	}
	h := &idem.LeaseHandler{Name: "uploader", Call: func(ctx context.Context, _ *idem.Lease, _ *idem.Message) error {
		db.Close() // heartbeats fail from here on; the lease runs out
		<-ctx.Done()
		return ctx.Err()
	}}
	if _, err := p.Process(context.Background(), h, &idem.Message{ID: "file-1"}); err == nil {
		t.Fatal("Process succeeded after losing its lease")
	}
	want := `
# HELP idem_leases_lost_total Lease mode: leases this worker lost, by handler and the operation that found out (heartbeat, done, failed, expired).
# TYPE idem_leases_lost_total counter
idem_leases_lost_total{handler="uploader",op="expired"} 1
# HELP idem_messages_total Messages processed, by handler and outcome (applied, duplicate, conflict, stale, in_flight, error).
# TYPE idem_messages_total counter
idem_messages_total{handler="uploader",outcome="error"} 1
`
	if err := testutil.GatherAndCompare(reg, strings.NewReader(want), "idem_leases_lost_total", "idem_messages_total"); err != nil {
		t.Fatal(err)
	}
}

// A LeaseConsumer's delivery of a message whose lease another worker holds
// is counted as in_flight, not as a retry of a failure.
func TestLeaseInFlightCounted(t *testing.T) {
	ctx := context.Background()
	reg := prometheus.NewPedanticRegistry()
	m, err := metrics.New(reg, nil)
	if err != nil {
		t.Fatal(err)
	}
	_, drv := testenv.SQLite(t, ":memory:", nil)
	lp, err := idem.NewLeaseProcessor(drv, &idem.LeaseConfig{Owner: "me"})
	if err != nil {
		t.Fatal(err)
	}
	h := &idem.LeaseHandler{Name: "mailer", Call: func(context.Context, *idem.Lease, *idem.Message) error { return nil }}
	c, err := idem.NewLeaseConsumer(lp, h, drv, &idem.ConsumerConfig{Hooks: []idem.Hook{m}})
	if err != nil {
		t.Fatal(err)
	}
	msg := &idem.Message{ID: "held", Payload: []byte("x")}
	if r, err := drv.LeaseClaim(ctx, &driver.LeaseClaimParams{Handler: "mailer", MessageID: msg.ID, PayloadHash: msg.PayloadHash(), Owner: "other", TTL: time.Minute}); err != nil || !r.Claimed {
		t.Fatalf("claim for another worker: %+v, %v", r, err)
	}
	if v := c.HandleDelivery(ctx, &idem.Delivery{Msg: msg, Attempt: 1}); v.Ack || v.Outcome != idem.InFlight {
		t.Fatalf("verdict %+v, want in flight", v)
	}
	if v := c.HandleDelivery(ctx, &idem.Delivery{Msg: &idem.Message{ID: "free", Payload: []byte("x")}, Attempt: 1}); !v.Ack {
		t.Fatalf("verdict %+v, want acknowledged", v)
	}
	want := `
# HELP idem_deliveries_total Broker deliveries decided by a Consumer, by handler and verdict (acked, retried, in_flight, dead_lettered).
# TYPE idem_deliveries_total counter
idem_deliveries_total{handler="mailer",verdict="acked"} 1
idem_deliveries_total{handler="mailer",verdict="in_flight"} 1
`
	if err := testutil.GatherAndCompare(reg, strings.NewReader(want), "idem_deliveries_total"); err != nil {
		t.Fatal(err)
	}
}

// TestConsumerBatchCountsEachDeliveryOnce: a batch that rolls back because
// of one poison message, or commits with a conflict, is decided again
// message by message by the Consumer; each message's outcome, error and
// duration is counted once, by the call that decided it.
func TestConsumerBatchCountsEachDeliveryOnce(t *testing.T) {
	ctx := context.Background()
	reg := prometheus.NewPedanticRegistry()
	m, err := metrics.New(reg, nil)
	if err != nil {
		t.Fatal(err)
	}
	p, drv := newProcessorAndDriver(t, m)
	c, err := idem.NewConsumer(p, scriptedHandler(), drv, &idem.ConsumerConfig{Hooks: []idem.Hook{m}})
	if err != nil {
		t.Fatal(err)
	}
	batch := func(ids, payloads string) {
		var ds []*idem.Delivery
		for i, id := range strings.Fields(ids) {
			ds = append(ds, &idem.Delivery{Msg: &idem.Message{ID: id, Payload: []byte(strings.Fields(payloads)[i])}, Attempt: 1})
		}
		for _, v := range c.HandleDeliveries(ctx, ds) {
			if !v.Ack {
				t.Fatalf("verdict %+v, want acked", v)
			}
		}
	}
	batch("a b p c", "ok ok poison ok") // rolls back, then one by one
	batch("x y", "v1 ok")
	batch("x z", "v2 ok") // x conflicts: committed with z, then dead-lettered alone
	want := `
# HELP idem_messages_total Messages processed, by handler and outcome (applied, duplicate, conflict, stale, in_flight, error).
# TYPE idem_messages_total counter
idem_messages_total{handler="balances",outcome="applied"} 6
idem_messages_total{handler="balances",outcome="conflict"} 1
idem_messages_total{handler="balances",outcome="error"} 1
`
	if err := testutil.GatherAndCompare(reg, strings.NewReader(want), "idem_messages_total"); err != nil {
		t.Fatal(err)
	}
	if got := histogramCounts(t, reg)["balances"]; got != 8 {
		t.Fatalf("%d durations observed, want 8 (one per message decided)", got)
	}
}

// TestInvalidHandlerNameIsNoLabel: a call with a handler name that is not
// valid (not even UTF-8) gets its ValidationError, and the metrics count
// it under handler "invalid" rather than panic on the label.
func TestInvalidHandlerNameIsNoLabel(t *testing.T) {
	reg := prometheus.NewPedanticRegistry()
	m, err := metrics.New(reg, nil)
	if err != nil {
		t.Fatal(err)
	}
	p := newProcessor(t, m)
	h := scriptedHandler()
	h.Name = "bad\xff"
	var ve *idem.ValidationError
	if _, err := p.Process(context.Background(), h, &idem.Message{ID: "a", Payload: []byte("ok")}); !errors.As(err, &ve) {
		t.Fatalf("Process: %v, want a ValidationError", err)
	}
	want := `
# HELP idem_messages_total Messages processed, by handler and outcome (applied, duplicate, conflict, stale, in_flight, error).
# TYPE idem_messages_total counter
idem_messages_total{handler="invalid",outcome="error"} 1
`
	if err := testutil.GatherAndCompare(reg, strings.NewReader(want), "idem_messages_total"); err != nil {
		t.Fatal(err)
	}
}

func TestStoreOutagesCounted(t *testing.T) {
	t.Parallel()
	reg := prometheus.NewRegistry()
	m, err := metrics.New(reg, nil)
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	m.OnVerdict(ctx, &idem.VerdictEvent{Handler: "balances", Verdict: idem.Verdict{Ack: true, Outcome: idem.Applied}})
	gauge := func() float64 {
		mfs, err := reg.Gather()
		if err != nil {
			t.Fatal(err)
		}
		for _, mf := range mfs {
			if mf.GetName() == "idem_consumer_store_up" {
				return mf.GetMetric()[0].GetGauge().GetValue()
			}
		}
		return -1
	}
	if g := gauge(); g != 1 {
		t.Fatalf("store up %v after a verdict, want 1", g)
	}
	m.OnOutage(ctx, &idem.OutageEvent{Handler: "balances", Down: true, Cause: errors.New("connection refused")})
	if g := gauge(); g != 0 {
		t.Fatalf("store up %v during an outage, want 0", g)
	}
	m.OnVerdict(ctx, &idem.VerdictEvent{Handler: "balances", Verdict: idem.Verdict{Ack: true, Outcome: idem.Applied}})
	if g := gauge(); g != 0 {
		t.Fatalf("store up %v: a verdict during the outage set it back", g)
	}
	m.OnOutage(ctx, &idem.OutageEvent{Handler: "balances", Duration: 5 * time.Second})
	want := `
# HELP idem_consumer_store_up 1 while a Consumer's store answers, 0 while it is down and the Consumer is paused, by handler.
# TYPE idem_consumer_store_up gauge
idem_consumer_store_up{handler="balances"} 1
# HELP idem_store_outages_total Outages of its store a Consumer paused for, by handler.
# TYPE idem_store_outages_total counter
idem_store_outages_total{handler="balances"} 1
`
	if err := testutil.GatherAndCompare(reg, strings.NewReader(want), "idem_consumer_store_up", "idem_store_outages_total"); err != nil {
		t.Fatal(err)
	}
}
