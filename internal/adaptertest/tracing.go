package adaptertest

import (
	"context"
	"database/sql"
	"path/filepath"
	"testing"
	"time"

	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"
	"go.opentelemetry.io/otel/trace"

	"github.com/idemhq/idem"
	"github.com/idemhq/idem/internal/testenv"
	"github.com/idemhq/idem/tracing"
)

// Publisher is what an adapter's publisher offers the outbox relay.
type Publisher interface {
	Publish(ctx context.Context, msgs []*idem.Message) error
}

// CheckTraceContext publishes one message to stream through pub with a
// producer's trace context in its headers, consumes it by passing an
// idem.Consumer whose processor has a tracing hook to start, and fails t
// unless the handler runs in the producer's trace and the processing
// span's parent is the producer's span: the headers survived the
// publisher, the broker and the adapter's default mapping.
func CheckTraceContext(t *testing.T, stream string, pub Publisher, start func(idem.DeliveryHandler)) {
	t.Helper()
	ctx := context.Background()
	rec := tracetest.NewSpanRecorder()
	tp := sdktrace.NewTracerProvider(sdktrace.WithSpanProcessor(rec))
	defer tp.Shutdown(ctx)
	tr, err := tracing.New(tp, nil)
	if err != nil {
		t.Fatal(err)
	}

	pctx, publish := tp.Tracer("shop").Start(ctx, "publish")
	msg := &idem.Message{ID: "order-1", Stream: stream, AggregateID: "order-1", Payload: []byte("placed"), Headers: map[string]string{}}
	tr.Inject(pctx, msg.Headers)
	publish.End()
	if err := pub.Publish(ctx, []*idem.Message{msg}); err != nil {
		t.Fatal(err)
	}

	_, drv := testenv.SQLite(t, filepath.Join(t.TempDir(), "traced.db"), nil)
	proc, err := idem.NewProcessor(drv, &idem.Config{Hooks: []idem.Hook{tr}})
	if err != nil {
		t.Fatal(err)
	}
	applied := make(chan trace.SpanContext, 1)
	h := &idem.Handler[*sql.Tx]{Name: "mailer", Apply: func(ctx context.Context, _ *sql.Tx, _ *idem.Message) error {
		select {
		case applied <- trace.SpanContextFromContext(ctx):
		default:
		}
		return nil
	}}
	c, err := idem.NewConsumer(proc, h, drv, nil)
	if err != nil {
		t.Fatal(err)
	}
	start(c)
	var got trace.SpanContext
	select {
	case got = <-applied:
	case <-time.After(20 * time.Second):
		t.Fatal("the message was not processed")
	}
	if got.TraceID() != publish.SpanContext().TraceID() {
		t.Fatalf("the handler ran in trace %v, want the producer's %v", got.TraceID(), publish.SpanContext().TraceID())
	}
	deadline := time.Now().Add(5 * time.Second)
	for {
		for _, s := range rec.Ended() {
			if s.Name() == "process mailer" {
				if s.Parent().SpanID() != publish.SpanContext().SpanID() {
					t.Fatalf("the processing span's parent is %v, want the producer's span %v", s.Parent().SpanID(), publish.SpanContext().SpanID())
				}
				return
			}
		}
		if time.Now().After(deadline) {
			t.Fatal("no processing span ended")
		}
		time.Sleep(10 * time.Millisecond)
	}
}
