// Package verdicts holds what the broker adapters share about the verdicts
// of a batch handler, and about decoding a delivery with a custom Map.
package verdicts

import (
	"errors"
	"fmt"
	"log/slog"
	"runtime/debug"
	"time"

	"github.com/idemhq/idem"
	"github.com/idemhq/idem/internal/errtext"
	"github.com/idemhq/idem/internal/lograte"
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

// Decode runs an adapter's Config.Map on one delivery (mapFn), making what
// a custom Map may do wrong a decode failure, an error matching
// idem.ErrInvalidMessage that the consumer dead-letters with the reason:
// a panic (a hostile delivery meeting a bug in the Map), which would
// otherwise end the process and, the delivery being unacknowledged, every
// restart after it, logged at Error with its stack through logs (one line
// per interval); and neither a message nor an error. source names the
// delivery. The message is nil whenever the error is not.
func Decode(logs *lograte.Limiter, log *slog.Logger, adapter, source string, mapFn func() (*idem.Message, error)) (msg *idem.Message, err error) {
	defer func() {
		if p := recover(); p != nil {
			logs.Log(log, slog.LevelError, adapter, adapter+": Config.Map panicked; the delivery is a decode failure",
				slog.String("source", source), slog.Any("panic", p), slog.String("stack", string(debug.Stack())))
			msg, err = nil, fmt.Errorf("%w: %s: Config.Map panicked on %s: %s", idem.ErrInvalidMessage, adapter, source, errtext.Quote(fmt.Sprint(p)))
		}
	}()
	msg, err = mapFn()
	switch {
	case err != nil:
		return nil, err
	case msg == nil:
		return nil, fmt.Errorf("%w: %s: Config.Map returned no message and no error for %s", idem.ErrInvalidMessage, adapter, source)
	}
	return msg, nil
}

// Unattempted reports whether err, of a verdict to retry, says that the
// delivery was not tried: held while the store was down, or cut short by
// the consumer's stop (idem.ConsumerConfig.StopGrace), until the adapter
// stopped. Such a retry is no attempt of the message.
func Unattempted(err error) bool {
	return errors.Is(err, idem.ErrStoreUnavailable) || errors.Is(err, idem.ErrStopped)
}
