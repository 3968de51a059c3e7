package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"strings"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
	"github.com/prometheus/client_golang/prometheus/promhttp"
)

// serveHealthTimeout bounds /healthz's query.
const serveHealthTimeout = 5 * time.Second

func serveCommand() *command {
	return &command{
		name:     "serve",
		synopsis: "--dsn DSN [--schema S] [--prefix P] [--addr HOST:PORT] [--token T | --actions] [--allow-host NAME] [--refresh D] [--read-timeout D]",
		summary:  "serve the store's state as Prometheus metrics and an operator console",
		help: `Serve runs an HTTP server over idem's tables:

  /metrics   Prometheus metrics read from the store at most once per
             --refresh (counting markers scans their table):
             idem_store_up, and per handler idem_store_markers,
             idem_store_duplicates_total, idem_store_stale_total,
             idem_store_leases{status}, idem_store_dead_letters{state},
             idem_store_conflicts, idem_store_oldest_marker_timestamp_seconds;
             the outbox's idem_outbox_pending, idem_outbox_failing,
             idem_outbox_published and idem_outbox_oldest_pending_age_seconds;
             and the Go runtime's metrics of this process
  /          the operator console: the same per-handler counts as
             'idem stats' (the reading /metrics uses, at most --refresh
             old), charts of the last hour that update by themselves
             (applied, duplicates and new dead letters per handler, the
             dead-letter depth, the outbox's lag), the outbox, and the
             dead letters by group
  /dlq       dead letters grouped by handler and fingerprint; a group's
             letters a page at a time; one letter with its error, payload,
             headers, history and the equivalent 'idem dlq' commands; and
             replay or discard of a letter, a selection or a whole group,
             each after a confirmation that says how many it changes
  /api/live  the charts' data as JSON
  /healthz   200 when the store answers and holds idem's tables, 503
             otherwise

The console is read-only unless a token is set, with --token or
IDEM_SERVE_TOKEN (at least 16 characters; the variable keeps it out of the
process list). Then an operator logs in with the token and a name, and may
replay and discard; the name is recorded with each action in the dead
letters' history. Scripts send 'Authorization: Bearer <token>' instead
(and X-Idem-Actor: <name>). --actions without a token generates one and
prints it, on a loopback --addr only: serve refuses to offer actions on
any other address without a token of yours. Put serve behind a proxy with
TLS to reach it from elsewhere. See docs/console.md.

The live counters of your consumers (outcomes, errors, verdicts, durations)
come from the metrics package's hook in your own processes; serve adds what
only the store knows. It listens on the loopback interface by default.
Against DNS rebinding it answers only the names it is known by: localhost,
loopback addresses, the host of --addr and the names given with
--allow-host (and any IP address when --addr is every interface); other
Host headers get 421. The store is read at most once per --refresh, and
one read at a time, however many scrapes and page views arrive; the
charts keep one reading per --refresh (at least a second) for an hour.
SIGINT or SIGTERM stops it gracefully (exit 0).

` + dsnHelp,
		setup: func(fs *flag.FlagSet) func(context.Context, *env, []string) error {
			sf := addStoreFlags(fs, "serve", false)
			addr := fs.String("addr", "127.0.0.1:9464", "`address` to listen on")
			var allow hostList
			fs.Var(&allow, "allow-host", "also answer requests for this host `name` (comma-separated or repeated), such as the name of a proxy in front")
			var refresh, readTimeout time.Duration
			durationVar(fs, &refresh, "refresh", 15*time.Second, "read the store for /metrics, the page and the charts at most once per `interval`; scrapes and views in between get the last reading")
			durationVar(fs, &readTimeout, "read-timeout", 10*time.Second, "bound on one read of the store for /metrics or the page (`duration`); counting takes about 0.2 s per million markers on Postgres")
			token := fs.String("token", "", "the console's actions need this `token` (default: $"+serveTokenEnv+"); without one the console is read-only")
			actions := fs.Bool("actions", false, "offer actions with a generated token, printed at start (loopback --addr only)")
			return func(ctx context.Context, e *env, args []string) error {
				if err := noArgs(args); err != nil {
					return err
				}
				if refresh < 0 {
					return usagef("--refresh %s is negative", refresh)
				}
				if readTimeout <= 0 {
					return usagef("--read-timeout %s must be positive", readTimeout)
				}
				tok := *token
				if tok == "" {
					tok = strings.TrimSpace(e.getenv(serveTokenEnv))
				}
				if err := checkToken(tok); err != nil {
					return usagef("--token: %w", err)
				}
				generated := false
				if *actions && tok == "" {
					if !loopbackAddr(*addr) {
						return usagef("--actions on %s, which is not a loopback address, needs a token of yours: set --token or %s", *addr, serveTokenEnv)
					}
					tok, generated = newToken(), true
				}
				s, err := sf.open(ctx, e)
				if err != nil {
					return err
				}
				defer s.Close()
				ln, err := net.Listen("tcp", *addr)
				if err != nil {
					return fmt.Errorf("listen: %w", err)
				}
				mode := "read-only console"
				if tok != "" {
					mode = "console with actions (log in with the token)"
				}
				fmt.Fprintf(e.stdout, "idem serve: %s on http://%s (metrics at /metrics; %s)\n", s, ln.Addr(), mode)
				if generated {
					fmt.Fprintf(e.stdout, "idem serve: the console's token for this run: %s\n", tok)
				}
				cache := newReadingCache(ctx, s, refresh, readTimeout)
				live := newLiveRing(max(refresh, time.Second))
				go live.run(ctx, cache)
				opts := &consoleOptions{Auth: newConsoleAuth(tok), Live: live, Logger: slog.New(slog.NewTextHandler(e.stderr, nil))}
				h := guard(newHostPolicy(*addr, allow), serveMuxFor(s, cache, readTimeout, opts))
				return serve(ctx, ln, newHTTPServer(ctx, h, defaultServeTimeouts(readTimeout)))
			}
		},
	}
}

// serve runs srv on ln until ctx ends, then shuts down gracefully.
func serve(ctx context.Context, ln net.Listener, srv *http.Server) error {
	done := make(chan error, 1)
	go func() { done <- srv.Serve(ln) }()
	select {
	case err := <-done:
		return fmt.Errorf("serve: %w", err)
	case <-ctx.Done():
	}
	sctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 5*time.Second)
	defer cancel()
	if err := srv.Shutdown(sctx); err != nil {
		return fmt.Errorf("shut down: %w", err)
	}
	if err := <-done; !errors.Is(err, http.ErrServerClosed) {
		return fmt.Errorf("serve: %w", err)
	}
	return nil
}

// newServeMux routes serve's endpoints for s, with a read-only console
// and no live view; /metrics reads the store at most once per refresh, and
// each read of the store is bounded by timeout and ends with ctx.
func newServeMux(ctx context.Context, s *store, refresh, timeout time.Duration) *http.ServeMux {
	return serveMuxFor(s, newReadingCache(ctx, s, refresh, timeout), timeout, nil)
}

// serveMuxFor routes serve's endpoints for s, with the store's counts from
// cache and the console configured by opts (nil: read-only, no live view).
func serveMuxFor(s *store, cache *readingCache, timeout time.Duration, opts *consoleOptions) *http.ServeMux {
	if opts == nil {
		opts = &consoleOptions{}
	}
	log := opts.Logger
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	reg := prometheus.NewRegistry()
	reg.MustRegister(newStoreCollector(cache), collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}))
	mux := http.NewServeMux()
	mux.Handle("GET /metrics", promhttp.HandlerFor(reg, promhttp.HandlerOpts{ErrorHandling: promhttp.ContinueOnError}))
	mux.HandleFunc("GET /healthz", func(w http.ResponseWriter, r *http.Request) {
		ctx, cancel := context.WithTimeout(r.Context(), serveHealthTimeout)
		defer cancel()
		n, _, err := s.schemaVersion(ctx)
		switch {
		case err != nil:
			http.Error(w, "store unavailable: "+err.Error(), http.StatusServiceUnavailable)
			return
		case n == 0:
			// It answers, but there is nothing to serve: what /metrics
			// reports as idem_store_up 0.
			http.Error(w, fmt.Sprintf("store unavailable: %s has no idem tables: run 'idem migrate' first", s), http.StatusServiceUnavailable)
			return
		}
		fmt.Fprintln(w, "ok")
	})
	c := &console{s: s, cache: cache, timeout: timeout, auth: opts.Auth, live: opts.Live, log: log, pages: consolePageTemplates}
	c.routes(mux)
	return mux
}

// storeCollector reports the store's state to scrapes, from the reading
// cache it shares with the page.
type storeCollector struct {
	cache *readingCache

	up, markers, duplicates, stale, leases        *prometheus.Desc
	deadLetters, conflicts, oldestMarker          *prometheus.Desc
	outboxPending, outboxFailing, outboxPublished *prometheus.Desc
	outboxAge                                     *prometheus.Desc
}

// storeReading is one read of the store.
type storeReading struct {
	handlers []*handlerStats
	outbox   *outboxReport // nil for a schema from before the outbox
	err      error
	// downSince is when the reads began to fail, for an outage in
	// progress; zero when this one succeeded.
	downSince time.Time
}

// readStore reads the per-handler counts and the outbox.
func readStore(ctx context.Context, s *store) storeReading {
	var r storeReading
	var version int
	if r.handlers, version, r.err = collectStats(ctx, s); r.err == nil && s.hasOutbox(version) {
		r.outbox, r.err = readOutbox(ctx, s, time.Now())
	}
	return r
}

func newStoreCollector(cache *readingCache) *storeCollector {
	h := []string{"handler"}
	return &storeCollector{
		cache:           cache,
		up:              prometheus.NewDesc("idem_store_up", "1 if the last read of idem's tables succeeded, else 0.", nil, nil),
		markers:         prometheus.NewDesc("idem_store_markers", "Markers stored (messages applied, or done in lease mode) since the last cleanup.", h, nil),
		duplicates:      prometheus.NewDesc("idem_store_duplicates_total", "Redeliveries skipped, as flushed by StatsRecorder hooks.", h, nil),
		stale:           prometheus.NewDesc("idem_store_stale_total", "Deliveries the ordering guard skipped as stale, as flushed by StatsRecorder hooks.", h, nil),
		leases:          prometheus.NewDesc("idem_store_leases", "Lease-mode messages by status: in_flight (running now) or failed (waiting for a retry or failed for good).", []string{"handler", "status"}, nil),
		deadLetters:     prometheus.NewDesc("idem_store_dead_letters", "Dead letters kept, by state: parked (waiting for an operator) or all.", []string{"handler", "state"}, nil),
		conflicts:       prometheus.NewDesc("idem_store_conflicts", "Dead letters whose message ID arrived with a different payload.", h, nil),
		oldestMarker:    prometheus.NewDesc("idem_store_oldest_marker_timestamp_seconds", "When the oldest marker was written (about the retention when cleanup runs).", h, nil),
		outboxPending:   prometheus.NewDesc("idem_outbox_pending", "Outbox rows waiting for the relay.", nil, nil),
		outboxFailing:   prometheus.NewDesc("idem_outbox_failing", "Pending outbox rows with at least one failed publish.", nil, nil),
		outboxPublished: prometheus.NewDesc("idem_outbox_published", "Published outbox rows waiting for cleanup.", nil, nil),
		outboxAge:       prometheus.NewDesc("idem_outbox_oldest_pending_age_seconds", "Age of the oldest pending outbox row (0 when none): the relay's lag.", nil, nil),
	}
}

// Describe implements prometheus.Collector.
func (c *storeCollector) Describe(ch chan<- *prometheus.Desc) {
	for _, d := range []*prometheus.Desc{c.up, c.markers, c.duplicates, c.stale, c.leases, c.deadLetters, c.conflicts, c.oldestMarker,
		c.outboxPending, c.outboxFailing, c.outboxPublished, c.outboxAge} {
		ch <- d
	}
}

// Collect implements prometheus.Collector. A store that cannot be read
// yields idem_store_up 0, not a failed scrape, so the outage can alert.
func (c *storeCollector) Collect(ch chan<- prometheus.Metric) {
	r, _ := c.cache.get(c.cache.base)
	if r.err != nil {
		ch <- constMetric(c.up, prometheus.GaugeValue, 0)
		return
	}
	ch <- constMetric(c.up, prometheus.GaugeValue, 1)
	labels := handlerLabels(r.handlers)
	for i, st := range r.handlers {
		h := labels[i]
		ch <- constMetric(c.markers, prometheus.GaugeValue, float64(st.Applied), h)
		ch <- constMetric(c.duplicates, prometheus.CounterValue, float64(st.Duplicates), h)
		ch <- constMetric(c.stale, prometheus.CounterValue, float64(st.Stale), h)
		ch <- constMetric(c.leases, prometheus.GaugeValue, float64(st.InFlight), h, "in_flight")
		ch <- constMetric(c.leases, prometheus.GaugeValue, float64(st.Failed), h, "failed")
		ch <- constMetric(c.deadLetters, prometheus.GaugeValue, float64(st.DeadParked), h, "parked")
		ch <- constMetric(c.deadLetters, prometheus.GaugeValue, float64(st.DeadTotal), h, "all")
		ch <- constMetric(c.conflicts, prometheus.GaugeValue, float64(st.Conflicts), h)
		if st.OldestMarker != nil {
			ch <- constMetric(c.oldestMarker, prometheus.GaugeValue, float64(st.OldestMarker.UnixMicro())/1e6, h)
		}
	}
	if ob := r.outbox; ob != nil {
		ch <- constMetric(c.outboxPending, prometheus.GaugeValue, float64(ob.Pending))
		ch <- constMetric(c.outboxFailing, prometheus.GaugeValue, float64(ob.Failing))
		ch <- constMetric(c.outboxPublished, prometheus.GaugeValue, float64(ob.Published))
		ch <- constMetric(c.outboxAge, prometheus.GaugeValue, float64(ob.AgeSeconds))
	}
}
