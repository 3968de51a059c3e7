package kafka_test

import (
	"testing"

	"github.com/idemhq/idem/internal/adaptertest"
)

// BenchmarkEndToEnd produces records to an in-process kfake cluster and
// consumes them into SQLite with a plain handler and through
// idem.Consumer, one record at a time and in batches of 100, reporting
// idem/plain as the ratio.
//
//	go test ./kafka -run '^$' -bench EndToEnd -benchtime 5000x
func BenchmarkEndToEnd(b *testing.B) {
	b.Run("per-message", func(b *testing.B) { adaptertest.EndToEnd(b, newBroker, 1) })
	b.Run("batch-100", func(b *testing.B) { adaptertest.EndToEnd(b, newBroker, 100) })
}
