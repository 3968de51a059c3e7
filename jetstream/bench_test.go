package jetstream_test

import (
	"testing"

	"github.com/idemhq/idem/internal/adaptertest"
)

// BenchmarkEndToEnd publishes messages to an embedded JetStream server and
// consumes them into SQLite with a plain handler and through idem.Consumer,
// one message at a time and in batches of 100, reporting idem/plain as the
// ratio.
//
//	go test ./jetstream -run '^$' -bench EndToEnd -benchtime 5000x
func BenchmarkEndToEnd(b *testing.B) {
	url := embedded(b)
	newBroker := func(t testing.TB) adaptertest.Broker { return newBroker(t, url) }
	b.Run("per-message", func(b *testing.B) { adaptertest.EndToEnd(b, newBroker, 1) })
	b.Run("batch-100", func(b *testing.B) { adaptertest.EndToEnd(b, newBroker, 100) })
}
