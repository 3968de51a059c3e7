package rabbitmq_test

import (
	"testing"

	"github.com/idemhq/idem/internal/adaptertest"
	"github.com/idemhq/idem/rabbitmq"
)

// BenchmarkEndToEnd publishes messages to a fresh quorum queue on the
// RabbitMQ server at IDEM_RABBITMQ_URL and consumes them with a plain
// handler (the same upserts, then the ack) and through idem.Consumer, one
// message at a time and in batches of 100, reporting idem/plain as the
// ratio, into SQLite at synchronous=FULL and NORMAL and into Postgres.
//
//	go test ./rabbitmq -run '^$' -bench 'EndToEnd/postgres' -benchtime 10000x
func BenchmarkEndToEnd(b *testing.B) {
	adaptertest.BenchEndToEnd(b, func(t testing.TB) adaptertest.Broker { return newBroker(t, rabbitmq.QueueQuorum) })
}

// BenchmarkConcurrency is BenchmarkEndToEnd's Postgres cases with a
// consumer deciding four aggregates at once (Config.Concurrency 4):
// compare its msgs/s with BenchmarkEndToEnd's.
//
//	go test ./rabbitmq -run '^$' -bench Concurrency -benchtime 10000x
func BenchmarkConcurrency(b *testing.B) {
	adaptertest.BenchConcurrency(b, func(t testing.TB) adaptertest.Broker {
		br := newBroker(t, rabbitmq.QueueQuorum)
		br.concurrency = 4
		return br
	})
}
