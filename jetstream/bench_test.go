package jetstream_test

import (
	"testing"

	"github.com/idemhq/idem/internal/adaptertest"
	"github.com/idemhq/idem/internal/testenv"
)

// BenchmarkEndToEnd publishes messages to an embedded JetStream server and
// consumes them with a plain handler and through idem.Consumer, one message
// at a time and in batches of 100, reporting idem/plain as the ratio, into
// SQLite at synchronous=FULL and NORMAL and into Postgres.
//
//	go test ./jetstream -run '^$' -bench EndToEnd -benchtime 20000x
func BenchmarkEndToEnd(b *testing.B) {
	url := testenv.EmbeddedNATS(b)
	adaptertest.BenchEndToEnd(b, func(t testing.TB) adaptertest.Broker { return newBroker(t, url) })
}

// BenchmarkConcurrency is BenchmarkEndToEnd's Postgres cases with a
// consumer deciding four aggregates at once (Config.Concurrency 4):
// compare its msgs/s with BenchmarkEndToEnd's.
//
//	go test ./jetstream -run '^$' -bench Concurrency -benchtime 10000x
func BenchmarkConcurrency(b *testing.B) {
	url := testenv.EmbeddedNATS(b)
	adaptertest.BenchConcurrency(b, func(t testing.TB) adaptertest.Broker {
		br := newBroker(t, url)
		br.concurrency = 4
		return br
	})
}
