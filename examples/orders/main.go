// Command orders is a small order service built on idem, on Postgres and
// NATS JetStream:
//
//   - POST /orders writes an order and its OrderPlaced event in one
//     transaction, the event through the outbox;
//   - a relay publishes the outbox to JetStream;
//   - an atomic projection keeps each customer's order count and total,
//     its writes and idem's marker in one transaction;
//   - a lease-mode handler sends the confirmation e-mail through an HTTP
//     API, with the lease's idempotency key;
//   - /metrics serves Prometheus metrics; a pruner deletes old markers and
//     published outbox rows; SIGINT or SIGTERM stops it gracefully.
//
// Run it against the services on localhost:
//
//	go run ./examples/orders
//	curl -X POST localhost:8080/orders -d '{"id":"o-1","customer":"ada","email":"ada@example.com","total_cents":4200}'
//	go run ./examples/orders -check   # kill the service mid-stream, then verify
//
// Without -mail it starts its own e-mail API on a local port, which logs
// what it sends.
package main

import (
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"os"
	"os/signal"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nats-io/nats.go"
	natsjs "github.com/nats-io/nats.go/jetstream"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promhttp"

	"github.com/idemhq/idem"
	"github.com/idemhq/idem/jetstream"
	"github.com/idemhq/idem/metrics"
	"github.com/idemhq/idem/outbox"
	"github.com/idemhq/idem/postgres"
)

// Handler names: stable, chosen once. They key the markers.
const (
	totalsHandler = "customer-totals"
	emailHandler  = "order-confirmation-email"
)

// envServiceArgs carries the arguments of a service process started by
// -check, so that a test binary can be that process too.
const envServiceArgs = "ORDERS_SERVICE_ARGS"

// config is the service's configuration, from flags.
type config struct {
	dsn, nats, listen, mail string
	schema, stream          string
	leaseTTL, ackWait       time.Duration
	claimTTL                time.Duration
}

// subject is where OrderPlaced events go: the outbox's stream, covered by
// the JetStream stream cfg.stream.
func (c *config) subject() string { return strings.ToLower(c.stream) + ".placed" }

func parseFlags(fs *flag.FlagSet, args []string) (*config, bool, error) {
	c := &config{}
	fs.StringVar(&c.dsn, "dsn", envOr("IDEM_POSTGRES_DSN", "postgres://postgres@127.0.0.1:5432/test?sslmode=disable"), "PostgreSQL DSN (env IDEM_POSTGRES_DSN)")
	fs.StringVar(&c.nats, "nats", envOr("IDEM_NATS_URL", nats.DefaultURL), "NATS URL (env IDEM_NATS_URL)")
	fs.StringVar(&c.listen, "listen", "127.0.0.1:8080", "HTTP address for /orders and /metrics")
	fs.StringVar(&c.mail, "mail", "", "e-mail API URL; empty: start one on a local port")
	fs.StringVar(&c.schema, "schema", "orders_example", "Postgres schema for the service's and idem's tables")
	fs.StringVar(&c.stream, "stream", "ORDERS", "JetStream stream; events go to the subject <stream in lower case>.placed")
	fs.DurationVar(&c.leaseTTL, "lease-ttl", 30*time.Second, "lease of an e-mail being sent")
	fs.DurationVar(&c.ackWait, "ack-wait", 30*time.Second, "JetStream AckWait of the durables")
	fs.DurationVar(&c.claimTTL, "claim-ttl", 30*time.Second, "claim of the outbox relay")
	check := fs.Bool("check", false, "run the service in a child process, kill it mid-stream, and verify")
	err := fs.Parse(args)
	return c, *check, err
}

func envOr(k, def string) string {
	if v := os.Getenv(k); v != "" {
		return v
	}
	return def
}

func main() {
	args := os.Args[1:]
	child := os.Getenv(envServiceArgs) != ""
	if child {
		args = strings.Split(os.Getenv(envServiceArgs), "\x1f")
	}
	cfg, check, err := parseFlags(flag.CommandLine, args)
	if err != nil {
		os.Exit(2)
	}
	if check && !child {
		err = selfCheck(context.Background(), cfg, os.Stdout)
	} else {
		err = serveUntilSignal(cfg)
	}
	if err != nil {
		fmt.Fprintln(os.Stderr, "orders:", err)
		os.Exit(1)
	}
}

// serveUntilSignal runs the service until SIGINT or SIGTERM.
func serveUntilSignal(cfg *config) error {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	log := slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelWarn}))
	return serve(ctx, cfg, os.Stdout, log)
}

// order is the body of POST /orders, and the OrderPlaced payload.
type order struct {
	ID         string `json:"id"`
	Customer   string `json:"customer"`
	Email      string `json:"email"`
	TotalCents int64  `json:"total_cents"`
}

// serve runs the service until ctx ends, then shuts it down: it stops
// taking orders, lets the requests under way finish, stops the relay and
// the consumers (whatever they had not acknowledged is redelivered), and
// returns.
func serve(ctx context.Context, cfg *config, out io.Writer, log *slog.Logger) error {
	pool, drv, err := openStore(ctx, cfg)
	if err != nil {
		return err
	}
	defer pool.Close()
	// Reconnect for ever: by default nats.go closes the connection
	// after 60 failed reconnects, and the relay and consumers then stop.
	nc, err := nats.Connect(cfg.nats, nats.MaxReconnects(-1))
	if err != nil {
		return err
	}
	defer nc.Close()
	js, err := natsjs.New(nc)
	if err != nil {
		return err
	}
	// The application creates its JetStream stream; idem does not. Its
	// subjects cover the outbox's stream, cfg.subject(). MaxAge bounds
	// redelivery: the pruner's horizon below.
	const maxAge = 72 * time.Hour
	if _, err := js.CreateOrUpdateStream(ctx, natsjs.StreamConfig{Name: cfg.stream,
		Subjects: []string{strings.ToLower(cfg.stream) + ".>"}, MaxAge: maxAge}); err != nil {
		return fmt.Errorf("create the JetStream stream: %w", err)
	}
	if cfg.mail == "" {
		api := newMailAPI(0, out)
		srv, url, err := api.listen()
		if err != nil {
			return err
		}
		defer srv.Close()
		cfg.mail = url
		fmt.Fprintf(out, "e-mail API on %s\n", url)
	}

	reg := prometheus.NewRegistry()
	m, err := metrics.New(reg, nil)
	if err != nil {
		return err
	}
	ob, err := outbox.New(drv)
	if err != nil {
		return err
	}

	// The workers run until workCtx ends, after the HTTP server stopped.
	workCtx, stopWork := context.WithCancel(context.WithoutCancel(ctx))
	defer stopWork()
	var wg sync.WaitGroup
	errc := make(chan error, 8)
	start := func(name string, run func(context.Context) error) {
		wg.Add(1)
		go func() {
			defer wg.Done()
			if err := run(workCtx); err != nil && !errors.Is(err, context.Canceled) {
				errc <- fmt.Errorf("%s: %w", name, err)
			}
		}()
	}

	// The relay: publishes committed outbox rows, marks them after the ack.
	pub, err := jetstream.NewPublisher(js)
	if err != nil {
		return err
	}
	// The metrics are its hook too: idem_outbox_published_total counts
	// the rows it published.
	relay, err := outbox.NewRelay(drv, pub, &outbox.RelayConfig{ClaimTTL: cfg.claimTTL, PollInterval: 200 * time.Millisecond,
		Hooks: []idem.Hook{m}, Logger: log})
	if err != nil {
		return err
	}
	start("relay", relay.Run)

	// The projection, in atomic mode.
	proc, err := idem.NewProcessor(drv, &idem.Config{Hooks: []idem.Hook{m}, Logger: log})
	if err != nil {
		return err
	}
	totals, err := idem.NewConsumer(proc, customerTotals(), drv, &idem.ConsumerConfig{Hooks: []idem.Hook{m}, Logger: log})
	if err != nil {
		return err
	}
	if err := startJetStream(js, cfg, totalsHandler, totals, log, start); err != nil {
		return err
	}
	start("replay "+totalsHandler, func(ctx context.Context) error { return totals.Run(ctx, 10*time.Second) })

	// The e-mail, in lease mode.
	lproc, err := idem.NewLeaseProcessor(drv, &idem.LeaseConfig{TTL: cfg.leaseTTL, BackoffBase: 100 * time.Millisecond,
		BackoffMax: 2 * time.Second, Hooks: []idem.Hook{m}, Logger: log})
	if err != nil {
		return err
	}
	mailer := &mailer{url: cfg.mail, client: &http.Client{Timeout: 10 * time.Second}}
	emails, err := idem.NewLeaseConsumer(lproc, mailer.handler(), drv, &idem.ConsumerConfig{Hooks: []idem.Hook{m}, Logger: log,
		Backoff: idem.Backoff{Base: 100 * time.Millisecond, Max: 2 * time.Second}})
	if err != nil {
		return err
	}
	if err := startJetStream(js, cfg, emailHandler, emails, log, start); err != nil {
		return err
	}
	start("replay "+emailHandler, func(ctx context.Context) error { return emails.Run(ctx, 10*time.Second) })

	// Retention: markers and published outbox rows older than a week.
	// The horizon is the stream's MaxAge: no redelivery comes later.
	pruner, err := idem.NewPruner(drv, &idem.RetentionConfig{Retention: 7 * 24 * time.Hour, RedeliveryHorizon: maxAge, Logger: log})
	if err != nil {
		return err
	}
	start("pruner", func(ctx context.Context) error { return pruner.Run(ctx, time.Hour) })

	// HTTP: orders in, metrics out.
	mux := http.NewServeMux()
	mux.Handle("POST /orders", placeOrder(pool, ob, cfg.subject()))
	mux.Handle("GET /metrics", promhttp.HandlerFor(reg, promhttp.HandlerOpts{}))
	ln, err := net.Listen("tcp", cfg.listen)
	if err != nil {
		return err
	}
	srv := &http.Server{Handler: mux, ReadHeaderTimeout: 5 * time.Second}
	fmt.Fprintf(out, "listening on %s\n", ln.Addr())
	go func() {
		if err := srv.Serve(ln); err != nil && !errors.Is(err, http.ErrServerClosed) {
			errc <- err
		}
	}()

	var failed error
	select {
	case <-ctx.Done():
	case failed = <-errc:
	}
	// Graceful shutdown: no new orders; those under way commit or not.
	// Then the workers stop: an e-mail being sent finishes or is handed
	// on, and what is not acknowledged comes back after AckWait.
	sctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if err := srv.Shutdown(sctx); err != nil {
		failed = errors.Join(failed, err)
	}
	stopWork()
	wg.Wait()
	fmt.Fprintln(out, "stopped")
	return failed
}

// openStore connects to Postgres with cfg.schema first on the search path,
// and migrates idem's tables and the service's.
func openStore(ctx context.Context, cfg *config) (*pgxpool.Pool, *postgres.Driver, error) {
	pc, err := pgxpool.ParseConfig(cfg.dsn)
	if err != nil {
		return nil, nil, err
	}
	pc.ConnConfig.RuntimeParams["search_path"] = cfg.schema
	pool, err := pgxpool.NewWithConfig(ctx, pc)
	if err != nil {
		return nil, nil, err
	}
	drv, err := postgres.New(pool, &postgres.Config{Schema: cfg.schema})
	if err == nil {
		err = drv.Migrate(ctx) // creates the schema too
	}
	if err == nil {
		_, err = pool.Exec(ctx, `
CREATE TABLE IF NOT EXISTS orders (
	id          text PRIMARY KEY,
	customer    text NOT NULL,
	email       text NOT NULL,
	total_cents bigint NOT NULL,
	created_at  timestamptz NOT NULL DEFAULT now()
);
CREATE TABLE IF NOT EXISTS customer_totals (
	customer    text PRIMARY KEY,
	orders      bigint NOT NULL,
	total_cents bigint NOT NULL
)`)
	}
	if err != nil {
		pool.Close()
		return nil, nil, err
	}
	return pool, drv, nil
}

// placeOrder writes the order and its event in one transaction. The
// order's ID comes from the client, so a retried request finds the order
// and adds no second event.
func placeOrder(pool *pgxpool.Pool, ob *outbox.Outbox[postgres.Tx], subject string) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		var o order
		if err := json.NewDecoder(http.MaxBytesReader(w, r.Body, 1<<16)).Decode(&o); err != nil || o.ID == "" || o.Customer == "" || o.Email == "" {
			http.Error(w, "want a JSON order with id, customer, email and total_cents", http.StatusBadRequest)
			return
		}
		payload, _ := json.Marshal(o)
		created := false
		err := pgx.BeginFunc(r.Context(), pool, func(tx pgx.Tx) error {
			tag, err := tx.Exec(r.Context(), `INSERT INTO orders (id, customer, email, total_cents) VALUES ($1, $2, $3, $4)
				ON CONFLICT (id) DO NOTHING`, o.ID, o.Customer, o.Email, o.TotalCents)
			if err != nil || tag.RowsAffected() == 0 {
				return err // a retry of an order already placed
			}
			created = true
			_, err = ob.AddNext(r.Context(), tx, subject, o.ID, "OrderPlaced", payload)
			return err
		})
		switch {
		case err != nil:
			http.Error(w, "could not place the order", http.StatusServiceUnavailable)
		case created:
			w.WriteHeader(http.StatusCreated)
		default:
			w.WriteHeader(http.StatusOK)
		}
	})
}

// customerTotals is the projection: its write and idem's marker commit
// together, so each order counts once.
func customerTotals() *idem.Handler[postgres.Tx] {
	return &idem.Handler[postgres.Tx]{
		Name: totalsHandler,
		Apply: idem.ByType(idem.Routes[postgres.Tx]{
			"OrderPlaced": func(ctx context.Context, tx postgres.Tx, msg *idem.Message) error {
				var o order
				if err := json.Unmarshal(msg.Payload, &o); err != nil {
					return idem.Permanent(err)
				}
				_, err := tx.Exec(ctx, `INSERT INTO customer_totals (customer, orders, total_cents) VALUES ($1, 1, $2)
					ON CONFLICT (customer) DO UPDATE SET orders = customer_totals.orders + 1,
						total_cents = customer_totals.total_cents + excluded.total_cents`, o.Customer, o.TotalCents)
				return err
			},
		}),
	}
}

// mailer sends confirmation e-mails through the e-mail API.
type mailer struct {
	url    string
	client *http.Client
}

// handler is the lease-mode handler. The idempotency key makes the API
// send once however often the call is repeated: after a crash between the
// call and done, or a lost lease.
func (m *mailer) handler() *idem.LeaseHandler {
	return &idem.LeaseHandler{
		Name: emailHandler,
		Call: idem.ByType(idem.Routes[*idem.Lease]{
			"OrderPlaced": func(ctx context.Context, l *idem.Lease, msg *idem.Message) error {
				var o order
				if err := json.Unmarshal(msg.Payload, &o); err != nil {
					return idem.Permanent(err)
				}
				body, _ := json.Marshal(email{To: o.Email, Subject: "Order " + o.ID + " confirmed",
					Text: fmt.Sprintf("Thank you. Your order %s of %d.%02d is placed.", o.ID, o.TotalCents/100, o.TotalCents%100)})
				req, err := http.NewRequestWithContext(ctx, http.MethodPost, m.url+"/send", strings.NewReader(string(body)))
				if err != nil {
					return err
				}
				req.Header.Set("Idempotency-Key", l.IdempotencyKey)
				resp, err := m.client.Do(req)
				if err != nil {
					return err // retried after the backoff
				}
				io.Copy(io.Discard, resp.Body)
				resp.Body.Close()
				switch {
				case resp.StatusCode < 300:
					return nil
				case resp.StatusCode < 500 && resp.StatusCode != http.StatusTooManyRequests:
					return idem.Permanent(fmt.Errorf("e-mail API: %s", resp.Status)) // a dead letter
				default:
					return fmt.Errorf("e-mail API: %s", resp.Status)
				}
			},
		}),
	}
}

// startJetStream runs a durable consumer named after the handler.
func startJetStream(js natsjs.JetStream, cfg *config, durable string, h idem.DeliveryHandler, log *slog.Logger, start func(string, func(context.Context) error)) error {
	c, err := jetstream.New(js, &jetstream.Config{Stream: cfg.stream, Durable: durable, Handler: h, AckWait: cfg.ackWait, Logger: log})
	if err != nil {
		return err
	}
	start("consumer "+durable, c.Run)
	return nil
}
