package kafka_test

import (
	"testing"

	"github.com/idemhq/idem/internal/adaptertest"
)

// BenchmarkEndToEnd produces records to an in-process kfake cluster and
// consumes them with a plain handler and through
// idem.Consumer, one record at a time and in batches of 100, reporting
// idem/plain as the ratio, into SQLite at synchronous=FULL and NORMAL and
// into Postgres.
//
//	go test ./kafka -run '^$' -bench EndToEnd -benchtime 20000x
func BenchmarkEndToEnd(b *testing.B) { adaptertest.BenchEndToEnd(b, newBroker) }

// BenchmarkConcurrency is BenchmarkEndToEnd's Postgres cases with a member
// handling its four partitions at once (Config.Concurrency 4): compare its
// msgs/s with BenchmarkEndToEnd's.
//
//	go test ./kafka -run '^$' -bench Concurrency -benchtime 10000x
func BenchmarkConcurrency(b *testing.B) {
	for _, c := range []struct {
		name string
		adaptertest.Shape
	}{
		{"per-message", adaptertest.Shape{Batch: 1}},
		{"batch-100-per-event", adaptertest.Shape{Batch: 100, PerEvent: true}},
	} {
		b.Run(adaptertest.StorePostgres+"/"+c.name, func(b *testing.B) {
			adaptertest.EndToEnd(b, newConcurrentBroker, adaptertest.StorePostgres, c.Shape)
		})
	}
}
