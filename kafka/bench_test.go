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
func BenchmarkConcurrency(b *testing.B) { adaptertest.BenchConcurrency(b, newConcurrentBroker) }
