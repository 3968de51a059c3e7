package main

import (
	"context"
	"errors"
	"flag"
	"os"
	"strings"
	"testing"

	"github.com/idemhq/idem/internal/testenv"
)

// TestMain lets the test binary serve as the service process that the
// self-check starts, kills and stops.
func TestMain(m *testing.M) {
	if args := os.Getenv(envServiceArgs); args != "" {
		cfg, _, err := parseFlags(flag.NewFlagSet("orders", flag.ContinueOnError), strings.Split(args, "\x1f"))
		if err == nil {
			err = serveUntilSignal(cfg)
		}
		if err != nil {
			os.Stderr.WriteString("orders: " + err.Error() + "\n")
			os.Exit(1)
		}
		os.Exit(0)
	}
	os.Exit(m.Run())
}

// TestSelfCheck runs the example's -check mode against Postgres and NATS
// on localhost: the service killed with SIGKILL while orders, the relay,
// the projection and the e-mails are under way, a tenth of the orders
// posted twice, the second service stopped with SIGTERM, and the store
// and the e-mail API verified against the unique intended orders.
func TestSelfCheck(t *testing.T) {
	cfg, _, err := parseFlags(flag.NewFlagSet("orders", flag.ContinueOnError), []string{
		"-dsn", testenv.PostgresDSN(), "-nats", testenv.NATSURL()})
	if err != nil {
		t.Fatal(err)
	}
	err = selfCheck(context.Background(), cfg, testWriter{t})
	if errors.Is(err, errUnavailable) {
		testenv.Unavailable(t, "Postgres or NATS", cfg.dsn+" "+cfg.nats, err)
	}
	if err != nil {
		t.Fatal(err)
	}
}

type testWriter struct{ t *testing.T }

func (w testWriter) Write(p []byte) (int, error) {
	w.t.Logf("%s", p)
	return len(p), nil
}
