package watermill_test

import (
	"context"
	"strconv"
	"testing"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/idemhq/idem"
	idemwm "github.com/idemhq/idem/watermill"
)

// An attempt count in the metadata (or from Config.Attempt) so large that
// one more overflows must not make the delivery's attempt negative (or
// zero, "unknown"): MaxAttempts would never be reached on it.
func TestHugeAttemptMetadataDoesNotOverflow(t *testing.T) {
	t.Parallel()
	var got []int
	dh := idem.DeliveryHandlerFunc(func(_ context.Context, d *idem.Delivery) idem.Verdict {
		got = append(got, d.Attempt)
		return idem.Verdict{Ack: true, Outcome: idem.Applied}
	})
	for _, cfg := range []*idemwm.Config{nil, {Attempt: func(*message.Message) int { return int(^uint(0) >> 1) }}} {
		h, err := idemwm.New(dh, cfg)
		if err != nil {
			t.Fatal(err)
		}
		for _, uuid := range []string{"evt-1", ""} { // decoded, and a decode failure
			m := message.NewMessage(uuid, []byte("x"))
			m.Metadata.Set(idemwm.MetadataAttempt, strconv.Itoa(int(^uint(0)>>1)))
			if err := h.Handle(m); err != nil {
				t.Fatal(err)
			}
		}
	}
	for i, a := range got {
		if a < 1 {
			t.Fatalf("delivery %d: attempt %d, want ≥ 1 (all %v)", i, a, got)
		}
	}
}
