// Package tracing records idem's processing as OpenTelemetry spans.
//
// Install a *Tracer as a processor hook (idem.Config.Hooks or
// idem.LeaseConfig.Hooks):
//
//	t, err := tracing.New(tracerProvider, nil)
//	proc, err := idem.NewProcessor(drv, &idem.Config{Hooks: []idem.Hook{t}})
//
// Every call of Process, ProcessTx, ProcessBatch, ProcessBatchTx and
// LeaseProcessor.Process becomes one span of kind consumer, named
// "process <handler>". The handler runs with the span in its context, so the
// spans of its own database or HTTP calls are children of it. The span
// carries:
//
//	idem.handler                    the handler name
//	messaging.operation.type        "process"
//	messaging.message.id            the message ID (single messages)
//	messaging.batch.message_count   the batch size (batches)
//	idem.outcome                    applied, duplicate, conflict, stale,
//	                                in_flight or none (single messages)
//	idem.applied, idem.duplicates,  how many of a batch's messages had each
//	idem.conflicts, idem.stale,     outcome
//	idem.not_applied
//	idem.lease                      true in lease mode
//
// and an error status when the call returned an error. Invalid UTF-8 in
// a span's name and strings (a handler name or message ID not validated
// yet, an error's text) is replaced by U+FFFD: OTLP exporters cannot
// encode it.
//
// Installed in an idem.Consumer's hooks (idem.ConsumerConfig.Hooks) as
// well, the Tracer adds a span "dead-letter <handler>" for every delivery
// the Consumer dead-letters, a decode failure included (which has no
// process span): it carries idem.handler, messaging.message.id when the
// delivery decoded, idem.attempt, idem.dead_letter.class and the error,
// and continues the producer's trace like a single message's span.
//
// The producer's trace context travels in the message headers (W3C
// traceparent and tracestate by default; Tracer.Inject writes them, for
// example into an outbox message). A single message whose call runs
// without a span in its context continues the producer's trace: the
// producer's span is the parent. Otherwise, and for every message of a
// batch (ProcessBatch, even of one message), the producer's span is a
// link. A call that panics (a bug in another hook or a driver) still ends
// its span, with an error status. The broker adapters' default
// mappings copy the headers they do not read into Message.Headers,
// so the context arrives without further work.
//
// Read the guide at https://github.com/idemhq/idem/blob/main/docs/operations.md#tracing
package tracing

import (
	"context"
	"fmt"
	"strings"
	"unicode/utf8"

	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	"go.opentelemetry.io/otel/propagation"
	"go.opentelemetry.io/otel/trace"

	"github.com/idemhq/idem"
)

// ScopeName is the instrumentation scope of the spans.
const ScopeName = "github.com/idemhq/idem/tracing"

// Config configures New. The zero value is valid.
type Config struct {
	// Propagator reads a producer's trace context from Message.Headers and
	// writes it in Inject. Default: W3C trace context
	// (propagation.TraceContext).
	Propagator propagation.TextMapPropagator
	// MaxLinks bounds the links a batch's span gets, one per message that
	// carries a trace context. Default 128; negative: none.
	MaxLinks int
}

// Tracer is an idem hook (idem.HookCall) that wraps every processing call
// in a span, and a consumer hook (idem.HookVerdict) that records every dead
// letter as a span. It is safe for concurrent use.
type Tracer struct {
	tracer   trace.Tracer
	prop     propagation.TextMapPropagator
	maxLinks int
}

// New returns a Tracer whose spans come from tp. It returns an error if tp
// is nil.
func New(tp trace.TracerProvider, cfg *Config) (*Tracer, error) {
	if tp == nil {
		return nil, fmt.Errorf("%w: tracing: nil tracer provider", idem.ErrInvalidConfig)
	}
	if cfg == nil {
		cfg = &Config{}
	}
	t := &Tracer{tracer: tp.Tracer(ScopeName), prop: cfg.Propagator, maxLinks: cfg.MaxLinks}
	if t.prop == nil {
		t.prop = propagation.TraceContext{}
	}
	if t.maxLinks == 0 {
		t.maxLinks = 128
	}
	return t, nil
}

// Inject writes the trace context of ctx into headers, for a message that
// a consumer behind a Tracer will process. headers must not be nil.
func (t *Tracer) Inject(ctx context.Context, headers map[string]string) {
	t.prop.Inject(ctx, propagation.MapCarrier(headers))
}

// spanKey finds a Tracer's span in a call's context, so that two Tracers
// on one processor each end their own.
type spanKey struct{ t *Tracer }

// OnCallStart implements idem.HookCall: it starts the call's span.
func (t *Tracer) OnCallStart(ctx context.Context, ev *idem.CallStart) context.Context {
	attrs := []attribute.KeyValue{
		attribute.String("idem.handler", text(ev.Handler)),
		attribute.String("messaging.operation.type", "process"),
	}
	if ev.Lease {
		attrs = append(attrs, attribute.Bool("idem.lease", true))
	}
	opts := []trace.SpanStartOption{trace.WithSpanKind(trace.SpanKindConsumer)}
	parent := ctx
	if !ev.Batch && len(ev.Messages) == 1 {
		if m := ev.Messages[0]; m != nil {
			attrs = append(attrs, attribute.String("messaging.message.id", text(m.ID)))
			parent, opts = t.continueProducer(ctx, m, opts)
		}
	} else {
		attrs = append(attrs, attribute.Int("messaging.batch.message_count", len(ev.Messages)))
		var links []trace.Link
		for _, m := range ev.Messages {
			if len(links) >= t.maxLinks {
				break
			}
			if m == nil {
				continue
			}
			if sc := t.producer(m); sc.IsValid() {
				links = append(links, trace.Link{SpanContext: sc})
			}
		}
		if len(links) > 0 {
			opts = append(opts, trace.WithLinks(links...))
		}
	}
	opts = append(opts, trace.WithAttributes(attrs...))
	ctx, span := t.tracer.Start(parent, "process "+text(ev.Handler), opts...)
	return context.WithValue(ctx, spanKey{t}, span)
}

// continueProducer makes the producer's span that m's headers carry the
// parent of a span started from the returned context, or a link of it
// when ctx holds a span already.
func (t *Tracer) continueProducer(ctx context.Context, m *idem.Message, opts []trace.SpanStartOption) (context.Context, []trace.SpanStartOption) {
	sc := t.producer(m)
	switch {
	case !sc.IsValid():
		return ctx, opts
	case trace.SpanContextFromContext(ctx).IsValid():
		return ctx, append(opts, trace.WithLinks(trace.Link{SpanContext: sc}))
	default:
		return trace.ContextWithRemoteSpanContext(ctx, sc), opts
	}
}

// OnVerdict implements idem.HookVerdict: a dead-lettered delivery gets a
// span of its own, ended at once; other verdicts none (the process span
// holds their outcome or error).
func (t *Tracer) OnVerdict(ctx context.Context, ev *idem.VerdictEvent) {
	if !ev.Verdict.DeadLettered {
		return
	}
	attrs := []attribute.KeyValue{
		attribute.String("idem.handler", text(ev.Handler)),
		attribute.Int("idem.attempt", ev.Attempt),
		attribute.String("idem.dead_letter.class", ev.Verdict.DeadLetterClass),
	}
	opts := []trace.SpanStartOption{trace.WithSpanKind(trace.SpanKindConsumer)}
	parent := ctx
	if ev.Message != nil {
		attrs = append(attrs, attribute.String("messaging.message.id", text(ev.Message.ID)))
		parent, opts = t.continueProducer(ctx, ev.Message, opts)
	}
	_, span := t.tracer.Start(parent, "dead-letter "+text(ev.Handler), append(opts, trace.WithAttributes(attrs...))...)
	if err := ev.Verdict.Err; err != nil {
		recordError(span, err)
		span.SetStatus(codes.Error, text(err.Error()))
	}
	span.End()
}

// text returns s with its invalid UTF-8 bytes replaced by U+FFFD. A
// span's names and strings must be UTF-8: OTLP carries them in protobuf
// strings, and an exporter that meets invalid bytes fails to encode the
// whole batch, dropping the other calls' spans with it. A call's message
// ID and handler name reach the hook before they are validated.
func text(s string) string {
	return strings.ToValidUTF8(s, "\uFFFD")
}

// recordError is span.RecordError, with the message made UTF-8 (see
// text): an error may quote a message's bytes.
func recordError(span trace.Span, err error) {
	msg := err.Error()
	if utf8.ValidString(msg) {
		span.RecordError(err)
		return
	}
	span.AddEvent("exception", trace.WithAttributes(
		attribute.String("exception.type", fmt.Sprintf("%T", err)),
		attribute.String("exception.message", text(msg)),
	))
}

// producer returns the span context m's headers carry, if any. It
// extracts into an empty context: the call's own span must not pass for
// the producer's when the headers carry none.
func (t *Tracer) producer(m *idem.Message) trace.SpanContext {
	if len(m.Headers) == 0 {
		return trace.SpanContext{}
	}
	return trace.SpanContextFromContext(t.prop.Extract(context.Background(), propagation.MapCarrier(m.Headers)))
}

// OnCallEnd implements idem.HookCall: it records the outcomes and the
// error and ends the call's span.
func (t *Tracer) OnCallEnd(ctx context.Context, ev *idem.CallEnd) {
	span, ok := ctx.Value(spanKey{t}).(trace.Span)
	if !ok {
		return
	}
	if !ev.Batch && len(ev.Outcomes) == 1 {
		span.SetAttributes(attribute.String("idem.outcome", ev.Outcomes[0].String()))
	} else if len(ev.Outcomes) > 0 {
		var applied, dup, conflict, stale, none int
		for _, o := range ev.Outcomes {
			switch o {
			case idem.Applied:
				applied++
			case idem.Duplicate:
				dup++
			case idem.Conflict:
				conflict++
			case idem.Stale:
				stale++
			default:
				none++
			}
		}
		span.SetAttributes(
			attribute.Int("idem.applied", applied),
			attribute.Int("idem.duplicates", dup),
			attribute.Int("idem.conflicts", conflict),
			attribute.Int("idem.stale", stale),
			attribute.Int("idem.not_applied", none),
		)
	}
	if ev.Err != nil {
		recordError(span, ev.Err)
		span.SetStatus(codes.Error, text(ev.Err.Error()))
	}
	span.End()
}
