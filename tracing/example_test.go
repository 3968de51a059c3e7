package tracing_test

import (
	"context"
	"database/sql"
	"fmt"
	"log"

	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"

	"github.com/idemhq/idem"
	"github.com/idemhq/idem/sqlite"
	"github.com/idemhq/idem/tracing"
)

// Install the Tracer as a processor hook. The producer injects its trace
// context into the message headers; the consumer's span continues that
// trace, and the handler's own spans become its children.
func Example() {
	ctx := context.Background()
	db, err := sqlite.Open(":memory:", nil)
	if err != nil {
		log.Fatal(err)
	}
	defer db.Close()
	drv, err := sqlite.New(db, nil)
	if err != nil {
		log.Fatal(err)
	}
	if err := drv.Migrate(ctx); err != nil {
		log.Fatal(err)
	}

	// In production: an SDK provider with an OTLP exporter.
	rec := tracetest.NewSpanRecorder()
	tp := sdktrace.NewTracerProvider(sdktrace.WithSpanProcessor(rec))
	defer tp.Shutdown(ctx)
	tr, err := tracing.New(tp, nil)
	if err != nil {
		log.Fatal(err)
	}
	proc, err := idem.NewProcessor(drv, &idem.Config{Hooks: []idem.Hook{tr}})
	if err != nil {
		log.Fatal(err)
	}

	// The producer's side: its span's context goes into the headers (for
	// example of an outbox message).
	pctx, publish := tp.Tracer("shop").Start(ctx, "publish OrderPlaced")
	headers := map[string]string{}
	tr.Inject(pctx, headers)
	publish.End()

	h := &idem.Handler[*sql.Tx]{Name: "mailer", Apply: func(context.Context, *sql.Tx, *idem.Message) error { return nil }}
	msg := &idem.Message{ID: "order-42", Payload: []byte("placed"), Headers: headers}
	for range 2 { // a delivery and a redelivery
		if _, err := proc.Process(ctx, h, msg); err != nil {
			log.Fatal(err)
		}
	}
	for _, s := range rec.Ended() {
		if s.Name() == "publish OrderPlaced" {
			continue
		}
		var outcome string
		for _, kv := range s.Attributes() {
			if kv.Key == "idem.outcome" {
				outcome = kv.Value.AsString()
			}
		}
		fmt.Printf("%s: %s, same trace as the producer: %v\n", s.Name(), outcome, s.SpanContext().TraceID() == publish.SpanContext().TraceID())
	}
	// Output:
	// process mailer: applied, same trace as the producer: true
	// process mailer: duplicate, same trace as the producer: true
}
