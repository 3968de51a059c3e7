package metrics_test

import (
	"context"
	"errors"
	"testing"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/idemhq/idem"
	"github.com/idemhq/idem/metrics"
)

// Buckets that are not in increasing order are a configuration error New
// reports; accepted, the histogram's first observation would panic on the
// processing goroutine, with the first message processed.
func TestNewRejectsBucketsOutOfOrder(t *testing.T) {
	for _, b := range [][]float64{{1, 0.5}, {0.1, 0.1}} {
		reg := prometheus.NewRegistry()
		m, err := metrics.New(reg, &metrics.Config{Buckets: b})
		if errors.Is(err, idem.ErrInvalidConfig) {
			if n, gerr := reg.Gather(); gerr != nil || len(n) != 0 {
				t.Fatalf("buckets %v refused, but %d metric families left registered (%v)", b, len(n), gerr)
			}
			continue
		}
		if err != nil {
			t.Fatalf("buckets %v: %v, want ErrInvalidConfig", b, err)
		}
		func() {
			defer func() {
				if r := recover(); r != nil {
					t.Fatalf("buckets %v accepted by New, then the first outcome panicked: %v", b, r)
				}
			}()
			m.OnOutcome(context.Background(), &idem.OutcomeEvent{Handler: "balances", Outcome: idem.Applied, BatchSize: 1})
		}()
		t.Fatalf("buckets %v: New accepted them, want ErrInvalidConfig", b)
	}
}
