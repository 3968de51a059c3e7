package main

import (
	"context"
	"os"
	"testing"
)

// TestMain lets the test binary serve as the worker process that the
// self-check starts and kills.
func TestMain(m *testing.M) {
	if n := os.Getenv(envWorker); n != "" {
		os.Exit(workerMain(n))
	}
	os.Exit(m.Run())
}

// TestSelfCheck runs the example's -check mode on an in-process Kafka: a
// group member killed after processing and before committing its
// offsets, a tenth of the events produced twice, and the stock levels and
// sequences verified against the unique intended events. It needs no
// service.
func TestSelfCheck(t *testing.T) {
	if err := run(context.Background(), "", 2000, true, testWriter{t}); err != nil {
		t.Fatal(err)
	}
}

type testWriter struct{ t *testing.T }

func (w testWriter) Write(p []byte) (int, error) {
	w.t.Logf("%s", p)
	return len(p), nil
}
