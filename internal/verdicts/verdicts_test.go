package verdicts_test

import (
	"log/slog"
	"testing"

	"github.com/idemhq/idem"
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
