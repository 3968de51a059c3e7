package verdicts_test

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"strings"
	"testing"
	"time"

	"github.com/idemhq/idem"
	"github.com/idemhq/idem/internal/lograte"
	"github.com/idemhq/idem/internal/testenv"
	"github.com/idemhq/idem/internal/verdicts"
)

func TestCheck(t *testing.T) {
	log := slog.New(slog.DiscardHandler)
	ok := []idem.Verdict{{Ack: true}, {Ack: true}}
	if got := verdicts.Check(ok, 2, log, "test"); len(got) != 2 || !got[0].Ack || !got[1].Ack {
		t.Fatalf("Check changed matching verdicts: %+v", got)
	}
	for _, vs := range [][]idem.Verdict{nil, ok[:1], append(ok, idem.Verdict{Ack: true})} {
		got := verdicts.Check(vs, 2, log, "test")
		if len(got) != 2 {
			t.Fatalf("Check(%d verdicts, 2) returned %d", len(vs), len(got))
		}
		for _, v := range got {
			if v.Ack || v.DeadLettered || v.RetryAfter != verdicts.Retry {
				t.Fatalf("Check(%d verdicts, 2) = %+v, want retries after %v", len(vs), got, verdicts.Retry)
			}
		}
	}
}

func TestDecode(t *testing.T) {
	logs := &testenv.Buffer{}
	log := slog.New(slog.NewTextHandler(logs, nil))
	limiter := lograte.New(time.Hour)
	for range 3 {
		msg, err := verdicts.Decode(limiter, log, "test", "q/1", func() (*idem.Message, error) { panic("boom") })
		if msg != nil || !errors.Is(err, idem.ErrInvalidMessage) || !strings.Contains(err.Error(), `panicked on q/1: "boom"`) {
			t.Fatalf("a panicking Map: %v, %v; want no message and ErrInvalidMessage naming the panic", msg, err)
		}
	}
	if n := strings.Count(logs.String(), "Config.Map panicked"); n != 1 {
		t.Errorf("3 panics logged %d times, want once per interval:\n%s", n, logs.String())
	}
	if msg, err := verdicts.Decode(limiter, log, "test", "q/2", func() (*idem.Message, error) { return nil, nil }); msg != nil || !errors.Is(err, idem.ErrInvalidMessage) {
		t.Errorf("a Map returning nothing: %v, %v; want ErrInvalidMessage", msg, err)
	}
	bad := errors.New("bad header")
	if msg, err := verdicts.Decode(limiter, log, "test", "q/3", func() (*idem.Message, error) { return &idem.Message{ID: "x"}, bad }); msg != nil || err != bad {
		t.Errorf("a Map failing with a message too: %v, %v; want its error alone", msg, err)
	}
	if msg, err := verdicts.Decode(limiter, log, "test", "q/4", func() (*idem.Message, error) { return &idem.Message{ID: "x"}, nil }); err != nil || msg.ID != "x" {
		t.Errorf("a Map that works: %v, %v", msg, err)
	}
}

func TestUnattempted(t *testing.T) {
	for _, tc := range []struct {
		err  error
		want bool
	}{
		{fmt.Errorf("%w: stopped", idem.ErrStoreUnavailable), true},
		{fmt.Errorf("%w: cancelled: %w", idem.ErrStopped, context.Canceled), true},
		{context.Canceled, false},
		{errors.New("handler failed"), false},
		{nil, false},
	} {
		if got := verdicts.Unattempted(tc.err); got != tc.want {
			t.Errorf("Unattempted(%v) = %v; want %v", tc.err, got, tc.want)
		}
	}
}
