package tracing_test

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"testing"

	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"
	"go.opentelemetry.io/otel/trace"

	"github.com/idemhq/idem"
	"github.com/idemhq/idem/internal/testenv"
	"github.com/idemhq/idem/sqlite"
	"github.com/idemhq/idem/tracing"
)

// setup returns a processor on in-memory SQLite behind a Tracer, the
// tracer provider and the recorder of its ended spans.
func setup(t *testing.T) (*idem.Processor[*sql.Tx], *tracing.Tracer, *sdktrace.TracerProvider, *tracetest.SpanRecorder) {
	proc, _, tr, tp, rec := setupStore(t)
	return proc, tr, tp, rec
}

// setupStore is setup, with the store's driver.
func setupStore(t *testing.T) (*idem.Processor[*sql.Tx], *sqlite.Driver, *tracing.Tracer, *sdktrace.TracerProvider, *tracetest.SpanRecorder) {
	t.Helper()
	rec := tracetest.NewSpanRecorder()
	tp := sdktrace.NewTracerProvider(sdktrace.WithSpanProcessor(rec))
	t.Cleanup(func() { _ = tp.Shutdown(context.Background()) })
	tr, err := tracing.New(tp, nil)
	if err != nil {
		t.Fatal(err)
	}
	_, drv := testenv.SQLite(t, ":memory:", nil)
	proc, err := idem.NewProcessor(drv, &idem.Config{Hooks: []idem.Hook{tr}})
	if err != nil {
		t.Fatal(err)
	}
	return proc, drv, tr, tp, rec
}

// handler records the span context its context carries per message.
func handler(seen map[string]trace.SpanContext) *idem.Handler[*sql.Tx] {
	return &idem.Handler[*sql.Tx]{
		Name: "balances",
		Apply: func(ctx context.Context, _ *sql.Tx, m *idem.Message) error {
			seen[m.ID] = trace.SpanContextFromContext(ctx)
			if string(m.Payload) == "fail" {
				return errors.New("account frozen")
			}
			return nil
		},
	}
}

// producerHeaders starts and ends a producer span and returns headers
// carrying its context.
func producerHeaders(t *testing.T, tp trace.TracerProvider, tr *tracing.Tracer) (map[string]string, trace.SpanContext) {
	t.Helper()
	ctx, span := tp.Tracer("producer").Start(context.Background(), "publish")
	span.End()
	h := map[string]string{"tenant": "a"}
	tr.Inject(ctx, h)
	if h["traceparent"] == "" {
		t.Fatalf("Inject wrote no traceparent: %v", h)
	}
	return h, span.SpanContext()
}

func attrs(s sdktrace.ReadOnlySpan) map[attribute.Key]attribute.Value {
	m := map[attribute.Key]attribute.Value{}
	for _, kv := range s.Attributes() {
		m[kv.Key] = kv.Value
	}
	return m
}

// processSpans returns the ended spans named "process balances".
func processSpans(rec *tracetest.SpanRecorder) []sdktrace.ReadOnlySpan {
	var out []sdktrace.ReadOnlySpan
	for _, s := range rec.Ended() {
		if s.Name() == "process balances" {
			out = append(out, s)
		}
	}
	return out
}

// A single message continues the producer's trace, the handler runs inside
// the span, and the redelivery is a span of its own with outcome
// duplicate.
func TestSingleMessageContinuesProducerTrace(t *testing.T) {
	proc, tr, tp, rec := setup(t)
	ctx := context.Background()
	h, producer := producerHeaders(t, tp, tr)
	seen := map[string]trace.SpanContext{}
	msg := &idem.Message{ID: "evt-1", Payload: []byte("10"), Headers: h}
	for range 2 {
		if _, err := proc.Process(ctx, handler(seen), msg); err != nil {
			t.Fatal(err)
		}
	}
	spans := processSpans(rec)
	if len(spans) != 2 {
		t.Fatalf("%d process spans, want 2", len(spans))
	}
	for i, want := range []string{"applied", "duplicate"} {
		s := spans[i]
		if s.SpanKind() != trace.SpanKindConsumer {
			t.Errorf("span %d kind %v, want consumer", i, s.SpanKind())
		}
		if s.Parent().SpanID() != producer.SpanID() || s.SpanContext().TraceID() != producer.TraceID() {
			t.Errorf("span %d: parent %v in trace %v, want the producer's span %v", i, s.Parent().SpanID(), s.SpanContext().TraceID(), producer.SpanID())
		}
		a := attrs(s)
		if a["idem.outcome"].AsString() != want || a["messaging.message.id"].AsString() != "evt-1" || a["idem.handler"].AsString() != "balances" {
			t.Errorf("span %d attributes %v, want outcome %s for evt-1 of balances", i, a, want)
		}
		if s.Status().Code == codes.Error {
			t.Errorf("span %d has error status %v", i, s.Status())
		}
	}
	if got := seen["evt-1"]; got.SpanID() != spans[0].SpanContext().SpanID() {
		t.Errorf("the handler ran in span %v, want the process span %v", got.SpanID(), spans[0].SpanContext().SpanID())
	}
}

// Under an ambient span, the call's span is its child and links to the
// producer; a message without a trace context gets no link, even though
// the context holds a span.
func TestAmbientSpanIsParentProducerIsLink(t *testing.T) {
	proc, tr, tp, rec := setup(t)
	h, producer := producerHeaders(t, tp, tr)
	ctx, ambient := tp.Tracer("consumer").Start(context.Background(), "poll")
	defer ambient.End()
	seen := map[string]trace.SpanContext{}
	if _, err := proc.Process(ctx, handler(seen), &idem.Message{ID: "evt-1", Payload: []byte("1"), Headers: h}); err != nil {
		t.Fatal(err)
	}
	if _, err := proc.Process(ctx, handler(seen), &idem.Message{ID: "evt-2", Payload: []byte("1"), Headers: map[string]string{"tenant": "a"}}); err != nil {
		t.Fatal(err)
	}
	spans := processSpans(rec)
	if len(spans) != 2 {
		t.Fatalf("%d process spans, want 2", len(spans))
	}
	for i, s := range spans {
		if s.Parent().SpanID() != ambient.SpanContext().SpanID() {
			t.Errorf("span %d: parent %v, want the ambient span %v", i, s.Parent().SpanID(), ambient.SpanContext().SpanID())
		}
	}
	if l := spans[0].Links(); len(l) != 1 || l[0].SpanContext.SpanID() != producer.SpanID() {
		t.Errorf("links of evt-1's span: %v, want the producer's span", l)
	}
	if l := spans[1].Links(); len(l) != 0 {
		t.Errorf("links of evt-2's span (no trace context in its headers): %v, want none", l)
	}
}

// A batch is one span, linked to each message's producer, with the count
// of each outcome; a failed call has an error status.
func TestBatchSpanAndFailure(t *testing.T) {
	proc, tr, tp, rec := setup(t)
	ctx := context.Background()
	seen := map[string]trace.SpanContext{}
	if _, err := proc.Process(ctx, handler(seen), &idem.Message{ID: "evt-0", Payload: []byte("1")}); err != nil {
		t.Fatal(err)
	}
	var msgs []*idem.Message
	var producers []trace.SpanContext
	for i := range 3 {
		h, sc := producerHeaders(t, tp, tr)
		producers = append(producers, sc)
		msgs = append(msgs, &idem.Message{ID: fmt.Sprintf("evt-%d", i+1), Payload: []byte("1"), Headers: h})
	}
	msgs = append(msgs, &idem.Message{ID: "evt-0", Payload: []byte("1")}, &idem.Message{ID: "evt-0b", Payload: []byte("2")})
	msgs = append(msgs, &idem.Message{ID: "evt-1", Payload: []byte("other")}) // same ID, other payload: conflict
	if _, err := proc.ProcessBatch(ctx, handler(seen), msgs); err != nil {
		t.Fatal(err)
	}
	if _, err := proc.Process(ctx, handler(seen), &idem.Message{ID: "evt-9", Payload: []byte("fail")}); err == nil {
		t.Fatal("want the handler's error")
	}
	spans := processSpans(rec)
	if len(spans) != 3 {
		t.Fatalf("%d process spans, want 3", len(spans))
	}
	batch := spans[1]
	a := attrs(batch)
	want := map[attribute.Key]int64{"messaging.batch.message_count": 6, "idem.applied": 4, "idem.duplicates": 1, "idem.conflicts": 1, "idem.stale": 0, "idem.not_applied": 0}
	for k, v := range want {
		if a[k].AsInt64() != v {
			t.Errorf("batch span %s = %v, want %d (all: %v)", k, a[k].Emit(), v, a)
		}
	}
	links := batch.Links()
	if len(links) != len(producers) {
		t.Fatalf("batch span has %d links, want %d", len(links), len(producers))
	}
	for i, l := range links {
		if l.SpanContext.SpanID() != producers[i].SpanID() {
			t.Errorf("link %d to %v, want producer %v", i, l.SpanContext.SpanID(), producers[i].SpanID())
		}
	}
	if seen["evt-2"].SpanID() != batch.SpanContext().SpanID() {
		t.Errorf("batch handler ran in span %v, want %v", seen["evt-2"].SpanID(), batch.SpanContext().SpanID())
	}
	failed := spans[2]
	if failed.Status().Code != codes.Error || attrs(failed)["idem.outcome"].AsString() != "none" || len(failed.Events()) == 0 {
		t.Errorf("failed call: status %v, attributes %v, %d events; want an error status, outcome none and the error recorded", failed.Status(), attrs(failed), len(failed.Events()))
	}
}

// Installed in a Consumer's hooks too, the Tracer records each dead letter
// as a span in the producer's trace, a delivery that did not decode
// included; an applied delivery gets none.
func TestDeadLetterSpan(t *testing.T) {
	proc, drv, tr, tp, rec := setupStore(t)
	h := &idem.Handler[*sql.Tx]{Name: "balances", Apply: func(_ context.Context, _ *sql.Tx, m *idem.Message) error {
		if string(m.Payload) == "frozen" {
			return idem.Permanent(errors.New("account frozen"))
		}
		return nil
	}}
	c, err := idem.NewConsumer(proc, h, drv, &idem.ConsumerConfig{Hooks: []idem.Hook{tr}, Logger: testenv.Logger(t)})
	if err != nil {
		t.Fatal(err)
	}
	headers, producer := producerHeaders(t, tp, tr)
	ctx := context.Background()
	for _, d := range []*idem.Delivery{
		{Msg: &idem.Message{ID: "evt-ok", Payload: []byte("1"), Headers: headers}, Attempt: 1},
		{Msg: &idem.Message{ID: "evt-frozen", Payload: []byte("frozen"), Headers: headers}, Attempt: 2},
		{Raw: []byte("garbage"), DecodeErr: errors.New("no idem-id header"), Attempt: 1},
	} {
		if v := c.HandleDelivery(ctx, d); !v.Ack {
			t.Fatalf("verdict %+v, want acknowledged", v)
		}
	}
	var dead []sdktrace.ReadOnlySpan
	for _, s := range rec.Ended() {
		if s.Name() == "dead-letter balances" {
			dead = append(dead, s)
		}
	}
	if len(dead) != 2 {
		t.Fatalf("%d dead-letter spans, want 2 (the permanent failure and the decode failure)", len(dead))
	}
	frozen, garbage := dead[0], dead[1]
	a := attrs(frozen)
	if a["messaging.message.id"].AsString() != "evt-frozen" || a["idem.dead_letter.class"].AsString() != idem.DeadLetterPermanent || a["idem.attempt"].AsInt64() != 2 {
		t.Errorf("dead-letter span of evt-frozen: attributes %v", a)
	}
	if frozen.Parent().SpanID() != producer.SpanID() || frozen.Status().Code != codes.Error {
		t.Errorf("dead-letter span of evt-frozen: parent %v, status %v; want the producer's span %v and an error", frozen.Parent().SpanID(), frozen.Status(), producer.SpanID())
	}
	a = attrs(garbage)
	if _, ok := a["messaging.message.id"]; ok || a["idem.dead_letter.class"].AsString() != idem.DeadLetterDecode || garbage.Status().Code != codes.Error {
		t.Errorf("dead-letter span of the undecodable delivery: attributes %v, status %v", a, garbage.Status())
	}
}

func TestNewRefusesNilProvider(t *testing.T) {
	if _, err := tracing.New(nil, nil); !errors.Is(err, idem.ErrInvalidConfig) {
		t.Errorf("nil provider: %v; want ErrInvalidConfig", err)
	}
}

// BenchmarkCall is the cost of a call's span with the SDK sampling every
// span and exporting none: OnCallStart and OnCallEnd for one message whose
// headers carry a producer's context, and for a batch of 100.
func BenchmarkCall(b *testing.B) {
	tp := sdktrace.NewTracerProvider()
	defer tp.Shutdown(context.Background())
	tr, err := tracing.New(tp, nil)
	if err != nil {
		b.Fatal(err)
	}
	pctx, span := tp.Tracer("producer").Start(context.Background(), "publish")
	h := map[string]string{}
	tr.Inject(pctx, h)
	span.End()
	for _, n := range []int{1, 100} {
		msgs := make([]*idem.Message, n)
		outs := make([]idem.Outcome, n)
		for i := range msgs {
			msgs[i] = &idem.Message{ID: fmt.Sprintf("evt-%d", i), Headers: h}
			outs[i] = idem.Applied
		}
		b.Run(fmt.Sprintf("messages-%d", n), func(b *testing.B) {
			b.ReportAllocs()
			ctx := context.Background()
			for b.Loop() {
				c := tr.OnCallStart(ctx, &idem.CallStart{Handler: "balances", Messages: msgs})
				tr.OnCallEnd(c, &idem.CallEnd{Handler: "balances", Outcomes: outs})
			}
		})
	}
}

// TestBatchOfOneIsABatch: a batch holding one message is traced as a
// batch, as the package says of batches: the producer is a link and the
// span counts the batch, so the trace's shape does not change with load.
func TestBatchOfOneIsABatch(t *testing.T) {
	proc, tr, tp, rec := setup(t)
	h, producer := producerHeaders(t, tp, tr)
	if _, err := proc.ProcessBatch(context.Background(), handler(map[string]trace.SpanContext{}), []*idem.Message{{ID: "a", Payload: []byte("1"), Headers: h}}); err != nil {
		t.Fatal(err)
	}
	spans := processSpans(rec)
	if len(spans) != 1 {
		t.Fatalf("%d process spans, want 1", len(spans))
	}
	s := spans[0]
	if s.Parent().TraceID() == producer.TraceID() {
		t.Errorf("the batch span continues the producer's trace; want a new trace linking to it")
	}
	if l := s.Links(); len(l) != 1 || l[0].SpanContext.SpanID() != producer.SpanID() {
		t.Errorf("links %+v, want the producer", l)
	}
	if a := attrs(s); a["messaging.batch.message_count"].AsInt64() != 1 || a["idem.applied"].AsInt64() != 1 {
		t.Errorf("attributes %v, want a batch of 1, applied 1", a)
	}
}

// panicky is an outcome hook with a bug.
type panicky struct{}

func (panicky) OnOutcome(context.Context, *idem.OutcomeEvent) { panic("hook bug") }

// TestSpanEndsWhenTheCallPanics: a call that panics (here in another
// hook) still ends its span, with an error status, and the panic goes on
// to the caller.
func TestSpanEndsWhenTheCallPanics(t *testing.T) {
	rec := tracetest.NewSpanRecorder()
	tp := sdktrace.NewTracerProvider(sdktrace.WithSpanProcessor(rec))
	t.Cleanup(func() { _ = tp.Shutdown(context.Background()) })
	tr, err := tracing.New(tp, nil)
	if err != nil {
		t.Fatal(err)
	}
	_, drv := testenv.SQLite(t, ":memory:", nil)
	proc, err := idem.NewProcessor(drv, &idem.Config{Hooks: []idem.Hook{tr, panicky{}}})
	if err != nil {
		t.Fatal(err)
	}
	for name, call := range map[string]func(){
		"Process": func() {
			_, _ = proc.Process(context.Background(), handler(map[string]trace.SpanContext{}), &idem.Message{ID: "a", Payload: []byte("1")})
		},
		"ProcessBatch": func() {
			_, _ = proc.ProcessBatch(context.Background(), handler(map[string]trace.SpanContext{}), []*idem.Message{{ID: "b", Payload: []byte("1")}})
		},
	} {
		before := len(processSpans(rec))
		func() {
			defer func() {
				if r := recover(); r != "hook bug" {
					t.Errorf("%s: recovered %v, want the hook's panic", name, r)
				}
			}()
			call()
		}()
		spans := processSpans(rec)
		if len(spans) != before+1 {
			t.Fatalf("%s: %d spans ended, want %d: the span was left open", name, len(spans), before+1)
		}
		if s := spans[len(spans)-1]; s.Status().Code != codes.Error {
			t.Errorf("%s: span status %v, want an error", name, s.Status())
		}
	}
}
