package tracing_test

import (
	"context"
	"database/sql"
	"errors"
	"testing"
	"unicode/utf8"

	sdktrace "go.opentelemetry.io/otel/sdk/trace"

	"github.com/idemhq/idem"
)

// A call's message ID and handler name reach the hook before they are
// validated, and a handler's error may carry any bytes; OTLP carries a
// span's strings as protobuf strings, and an exporter meeting invalid
// UTF-8 fails the whole batch, dropping the other calls' spans. So every
// name and string of the spans is valid UTF-8, whatever the call's. Before,
// they carried the bytes as given.
func TestSpanStringsAreUTF8(t *testing.T) {
	proc, _, _, rec := setup(t)
	ctx := context.Background()
	bad := &idem.Handler[*sql.Tx]{Name: "bal\xffances", Apply: func(context.Context, *sql.Tx, *idem.Message) error { return nil }}
	if _, err := proc.Process(ctx, bad, &idem.Message{ID: "evt-1", Payload: []byte("1")}); err == nil {
		t.Fatal("Process with a handler name of invalid UTF-8 succeeded")
	}
	good := &idem.Handler[*sql.Tx]{Name: "balances", Apply: func(context.Context, *sql.Tx, *idem.Message) error {
		return errors.New("frozen: \xfe\xff")
	}}
	if _, err := proc.Process(ctx, good, &idem.Message{ID: "evt-\xc3", Payload: []byte("1")}); err == nil {
		t.Fatal("Process with an ID of invalid UTF-8 succeeded")
	}
	if _, err := proc.Process(ctx, good, &idem.Message{ID: "evt-2", Payload: []byte("1")}); err == nil {
		t.Fatal("Process whose handler failed succeeded")
	}
	spans := rec.Ended()
	if len(spans) != 3 {
		t.Fatalf("%d spans, want 3", len(spans))
	}
	for _, s := range spans {
		checkUTF8(t, s)
	}
}

// checkUTF8 fails t for each string of s that is not valid UTF-8.
func checkUTF8(t *testing.T, s sdktrace.ReadOnlySpan) {
	t.Helper()
	if !utf8.ValidString(s.Name()) {
		t.Errorf("span name %q", s.Name())
	}
	if !utf8.ValidString(s.Status().Description) {
		t.Errorf("span %q: status %q", s.Name(), s.Status().Description)
	}
	for _, kv := range s.Attributes() {
		if !utf8.ValidString(kv.Value.Emit()) {
			t.Errorf("span %q: attribute %s = %q", s.Name(), kv.Key, kv.Value.Emit())
		}
	}
	for _, ev := range s.Events() {
		for _, kv := range ev.Attributes {
			if !utf8.ValidString(kv.Value.Emit()) {
				t.Errorf("span %q: event %s attribute %s = %q", s.Name(), ev.Name, kv.Key, kv.Value.Emit())
			}
		}
	}
}
