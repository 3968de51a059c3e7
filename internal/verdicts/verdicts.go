// Package verdicts holds what the broker adapters share about the verdicts
// of a batch handler.
package verdicts

import (
	"log/slog"
	"time"

	"github.com/idemhq/idem"
)

// Retry is the delay of the retries Check puts in place of a batch's
// verdicts.
const Retry = time.Second

// Check returns vs when it holds one verdict per delivery of a batch of n.
// Otherwise the handler is broken: it logs that at Error and returns n
// retries after Retry, so that no delivery is acknowledged on a guess and
// none is lost.
func Check(vs []idem.Verdict, n int, log *slog.Logger, adapter string) []idem.Verdict {
	if len(vs) == n {
		return vs
	}
	log.Error(adapter+": the batch handler returned a verdict count unlike its deliveries'; retrying them", slog.Int("deliveries", n), slog.Int("verdicts", len(vs)))
	vs = make([]idem.Verdict, n)
	for i := range vs {
		vs[i].RetryAfter = Retry
	}
	return vs
}
