package jetstream_test

import (
	"testing"

	"github.com/idemhq/idem/internal/adaptertest"
)

// BenchmarkEndToEnd publishes messages to an embedded JetStream server and
// consumes them into SQLite with a plain handler and through idem.Consumer,
// one message at a time and in batches of 100, reporting idem/plain as the
// ratio, with SQLite at synchronous=FULL and NORMAL.
//
//	go test ./jetstream -run '^$' -bench EndToEnd -benchtime 20000x
func BenchmarkEndToEnd(b *testing.B) {
	url := embedded(b)
	adaptertest.BenchEndToEnd(b, func(t testing.TB) adaptertest.Broker { return newBroker(t, url) })
}
