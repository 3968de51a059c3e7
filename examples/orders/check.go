package main

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"os"
	"os/exec"
	"runtime"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nats-io/nats.go"
	natsjs "github.com/nats-io/nats.go/jetstream"

	"github.com/idemhq/idem"
	"github.com/idemhq/idem/outbox"
	"github.com/idemhq/idem/postgres"
)

// errUnavailable marks a service the check could not reach.
var errUnavailable = errors.New("service unavailable")

const (
	checkOrders    = 200
	checkCustomers = 10
)

// intendedOrders returns the unique orders the check places.
func intendedOrders() []order {
	os := make([]order, checkOrders)
	for i := range os {
		c := fmt.Sprintf("cust-%02d", i%checkCustomers)
		os[i] = order{ID: fmt.Sprintf("o-%04d", i), Customer: c, Email: c + "@example.com", TotalCents: int64(100 + (i*7919)%10000)}
	}
	return os
}

// selfCheck runs the service in a child process, places orders over HTTP
// (a tenth of them twice, as a client retrying after a timeout would),
// kills the service with SIGKILL while orders, relay, projection and
// e-mails are under way, starts it again, and stops the second one with
// SIGTERM once everything has settled. It then checks the store and the
// e-mail API against the unique intended orders.
func selfCheck(ctx context.Context, base *config, out io.Writer) error {
	start := time.Now()
	cfg := *base
	run := fmt.Sprintf("%d_%d", os.Getpid(), time.Now().UnixNano()%1e9)
	cfg.schema, cfg.stream = "orders_check_"+run, "ORDERS_CHECK_"+run

	// Reach the services first, and clean up after.
	pc, err := pgxpool.ParseConfig(cfg.dsn)
	if err != nil {
		return err
	}
	pc.ConnConfig.RuntimeParams["search_path"] = cfg.schema
	pool, err := pgxpool.NewWithConfig(ctx, pc)
	if err == nil {
		err = pool.Ping(ctx)
	}
	if err != nil {
		return fmt.Errorf("%w: Postgres at %s: %v", errUnavailable, cfg.dsn, err)
	}
	defer pool.Close()
	defer pool.Exec(context.WithoutCancel(ctx), `DROP SCHEMA IF EXISTS `+pgx.Identifier{cfg.schema}.Sanitize()+` CASCADE`)
	nc, err := nats.Connect(cfg.nats)
	if err != nil {
		return fmt.Errorf("%w: NATS at %s: %v", errUnavailable, cfg.nats, err)
	}
	defer nc.Close()
	js, err := natsjs.New(nc)
	if err != nil {
		return err
	}
	defer js.DeleteStream(context.WithoutCancel(ctx), cfg.stream)

	// The e-mail API lives here, so that what it sent survives the kill.
	// It fails the first request of about a quarter of the keys.
	api := newMailAPI(4, nil)
	api.delay = 10 * time.Millisecond
	apiSrv, apiURL, err := api.listen()
	if err != nil {
		return err
	}
	defer apiSrv.Close()
	cfg.mail = apiURL

	// Service 1, then the first half of the orders.
	s1, err := startService(ctx, &cfg, out, "service 1")
	if err != nil {
		return err
	}
	defer s1.kill()
	var addr atomic.Value
	addr.Store(s1.addr)
	orders := intendedOrders()
	var posts atomic.Int64
	place := func(os []order) error {
		var wg sync.WaitGroup
		errc := make(chan error, len(os))
		ch := make(chan int)
		for range 4 {
			wg.Add(1)
			go func() {
				defer wg.Done()
				for i := range ch {
					copies := 1
					if i%10 == 7 {
						copies = 2 // the client retries an order already placed
					}
					for range copies {
						if err := post(ctx, &addr, os[i]); err != nil {
							errc <- err
							return
						}
						posts.Add(1)
					}
				}
			}()
		}
		for i := range os {
			ch <- i
		}
		close(ch)
		wg.Wait()
		close(errc)
		return <-errc
	}
	half := len(orders) / 2
	if err := place(orders[:half]); err != nil {
		return err
	}

	// The second half goes in while service 1 is killed: requests fail
	// and are retried against service 2.
	placed := make(chan error, 1)
	go func() { placed <- place(orders[half:]) }()
	time.Sleep(30 * time.Millisecond)
	snapshot := progress(ctx, pool)
	if err := s1.kill(); err != nil {
		return err
	}
	fmt.Fprintf(out, "service 1 killed by SIGKILL while placing orders, with %s\n", snapshot)
	s2, err := startService(ctx, &cfg, out, "service 2")
	if err != nil {
		return err
	}
	defer s2.kill()
	addr.Store(s2.addr)
	if err := <-placed; err != nil {
		return err
	}
	fmt.Fprintf(out, "placed %d unique orders in %d requests\n", len(orders), posts.Load())

	// Wait until everything has settled.
	if err := waitSettled(ctx, pool, js, &cfg, len(orders)); err != nil {
		return err
	}
	scraped, err := httpGet(ctx, "http://"+s2.addr+"/metrics")
	if err != nil {
		return err
	}
	// Graceful shutdown: SIGTERM, and a clean exit.
	if err := s2.stop(15 * time.Second); err != nil {
		return err
	}
	fmt.Fprintln(out, "service 2 stopped by SIGTERM and exited 0")

	var rep mailReport
	body, err := httpGet(ctx, apiURL+"/sent")
	if err == nil {
		err = json.Unmarshal([]byte(body), &rep)
	}
	if err != nil {
		return err
	}
	if err := verifyOrders(ctx, pool, &cfg, orders, &rep, scraped, out, time.Since(start)); err != nil {
		return err
	}
	return verifyRetention(ctx, pool, &cfg, len(orders), out)
}

// verifyRetention runs the service's retention as it would run eight days
// later: every marker, done e-mail row and published outbox row goes.
func verifyRetention(ctx context.Context, pool *pgxpool.Pool, cfg *config, n int, out io.Writer) error {
	drv, err := postgres.New(pool, &postgres.Config{Schema: cfg.schema})
	if err != nil {
		return err
	}
	p, err := idem.NewPruner(drv, &idem.RetentionConfig{Retention: 7 * 24 * time.Hour, RedeliveryHorizon: 72 * time.Hour,
		Logger: slog.New(slog.DiscardHandler), Now: func() time.Time { return time.Now().Add(8 * 24 * time.Hour) }})
	if err != nil {
		return err
	}
	st, err := p.Prune(ctx)
	if err != nil {
		return err
	}
	var markers, outboxRows int
	if err := pool.QueryRow(ctx, `SELECT (SELECT count(*) FROM idem_processed) + (SELECT count(*) FROM idem_markers), (SELECT count(*) FROM idem_outbox)`).Scan(&markers, &outboxRows); err != nil {
		return err
	}
	if st.Deleted != 2*n || st.OutboxDeleted != n || markers != 0 || outboxRows != 0 {
		return fmt.Errorf("retention eight days later deleted %d markers and %d outbox rows, leaving %d and %d; want %d and %d deleted, none left",
			st.Deleted, st.OutboxDeleted, markers, outboxRows, 2*n, n)
	}
	fmt.Fprintf(out, "retention, run as eight days later: %d markers and %d published outbox rows deleted\n", st.Deleted, st.OutboxDeleted)
	return nil
}

// progress says how far the orders have gone.
func progress(ctx context.Context, pool *pgxpool.Pool) string {
	var placed, pending, projected, emailed int
	err := pool.QueryRow(ctx, `SELECT (SELECT count(*) FROM orders),
		(SELECT count(*) FROM idem_outbox WHERE published_at IS NULL),
		(SELECT coalesce(sum(orders), 0) FROM customer_totals),
		(SELECT count(*) FROM idem_processed WHERE handler = $1 AND status = 'done')`, emailHandler).Scan(&placed, &pending, &projected, &emailed)
	if err != nil {
		return "progress unknown: " + err.Error()
	}
	return fmt.Sprintf("%d orders placed, %d not yet published, %d projected, %d e-mailed", placed, pending, projected, emailed)
}

// post places o, retrying until a service answers 200 or 201.
func post(ctx context.Context, addr *atomic.Value, o order) error {
	body, _ := json.Marshal(o)
	deadline := time.Now().Add(30 * time.Second)
	for {
		req, _ := http.NewRequestWithContext(ctx, http.MethodPost, "http://"+addr.Load().(string)+"/orders", strings.NewReader(string(body)))
		resp, err := http.DefaultClient.Do(req)
		if err == nil {
			io.Copy(io.Discard, resp.Body)
			resp.Body.Close()
			if resp.StatusCode == http.StatusOK || resp.StatusCode == http.StatusCreated {
				return nil
			}
			err = errors.New(resp.Status)
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("order %s: %w", o.ID, err)
		}
		time.Sleep(50 * time.Millisecond)
	}
}

func httpGet(ctx context.Context, url string) (string, error) {
	req, _ := http.NewRequestWithContext(ctx, http.MethodGet, url, nil)
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return "", err
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	return string(b), err
}

// service is a child process running serve.
type service struct {
	cmd    *exec.Cmd
	addr   string
	exited chan error
	once   sync.Once
}

// startService starts the service in a child process, with short leases
// and ack waits so that a killed one's work is taken over in seconds.
func startService(ctx context.Context, cfg *config, out io.Writer, name string) (*service, error) {
	args := []string{"-listen", "127.0.0.1:0", "-dsn", cfg.dsn, "-nats", cfg.nats, "-mail", cfg.mail,
		"-schema", cfg.schema, "-stream", cfg.stream, "-lease-ttl", "2s", "-ack-wait", "2s", "-claim-ttl", "2s"}
	cmd := exec.CommandContext(ctx, os.Args[0])
	cmd.Env = append(os.Environ(), envServiceArgs+"="+strings.Join(args, "\x1f"))
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		return nil, err
	}
	cmd.Stderr = prefixed(out, name+": ")
	if err := cmd.Start(); err != nil {
		return nil, err
	}
	s := &service{cmd: cmd, exited: make(chan error, 1)}
	addrc := make(chan string, 1)
	go func() {
		sc := bufio.NewScanner(stdout)
		for sc.Scan() {
			if a, ok := strings.CutPrefix(sc.Text(), "listening on "); ok {
				addrc <- a
			}
			fmt.Fprintf(out, "%s: %s\n", name, sc.Text())
		}
		s.exited <- cmd.Wait()
	}()
	select {
	case s.addr = <-addrc:
		return s, nil
	case err := <-s.exited:
		return nil, fmt.Errorf("%s exited before listening: %v", name, err)
	case <-time.After(20 * time.Second):
		s.kill()
		return nil, fmt.Errorf("%s did not listen within 20 s", name)
	}
}

// kill sends SIGKILL and checks the process died of it.
func (s *service) kill() error {
	var err error
	s.once.Do(func() {
		_ = s.cmd.Process.Kill()
		<-s.exited
		ws, _ := s.cmd.ProcessState.Sys().(syscall.WaitStatus)
		if runtime.GOOS != "windows" && !(ws.Signaled() && ws.Signal() == syscall.SIGKILL) {
			err = fmt.Errorf("the service was to die of SIGKILL; it ended with %v", s.cmd.ProcessState)
		}
	})
	return err
}

// stop sends SIGTERM and waits for a clean exit.
func (s *service) stop(timeout time.Duration) error {
	var err error
	s.once.Do(func() {
		_ = s.cmd.Process.Signal(syscall.SIGTERM)
		select {
		case werr := <-s.exited:
			if werr != nil {
				err = fmt.Errorf("after SIGTERM the service exited with %v", werr)
			}
		case <-time.After(timeout):
			_ = s.cmd.Process.Kill()
			<-s.exited
			err = fmt.Errorf("the service did not stop within %s of SIGTERM", timeout)
		}
	})
	return err
}

// waitSettled waits until every order is published, projected and
// e-mailed, and both durables have acknowledged everything.
func waitSettled(ctx context.Context, pool *pgxpool.Pool, js natsjs.JetStream, cfg *config, n int) error {
	deadline := time.Now().Add(60 * time.Second)
	var state string
	for time.Now().Before(deadline) {
		time.Sleep(100 * time.Millisecond)
		var pending, projected, emailed int
		err := pool.QueryRow(ctx, `SELECT
			(SELECT count(*) FROM idem_outbox WHERE published_at IS NULL),
			(SELECT coalesce(sum(orders), 0) FROM customer_totals),
			(SELECT count(*) FROM idem_processed WHERE handler = $1 AND status = 'done')`, emailHandler).Scan(&pending, &projected, &emailed)
		if err != nil {
			return err
		}
		acked := true
		for _, d := range []string{totalsHandler, emailHandler} {
			c, err := js.Consumer(ctx, cfg.stream, d)
			if err != nil {
				return err
			}
			info, err := c.Info(ctx)
			if err != nil {
				return err
			}
			acked = acked && info.NumPending == 0 && info.NumAckPending == 0
		}
		state = fmt.Sprintf("outbox pending %d, projected %d, e-mailed %d of %d, durables acknowledged: %v", pending, projected, emailed, n, acked)
		if pending == 0 && projected >= n && emailed >= n && acked {
			return nil
		}
	}
	return errors.New("not settled within 60 s: " + state)
}

// verifyOrders compares the store, the e-mail API and the metrics with
// the unique intended orders.
func verifyOrders(ctx context.Context, pool *pgxpool.Pool, cfg *config, orders []order, rep *mailReport, scraped string, out io.Writer, took time.Duration) error {
	var problems []string
	bad := func(f string, a ...any) { problems = append(problems, fmt.Sprintf(f, a...)) }

	want := map[string][2]int64{} // customer: orders, total
	for _, o := range orders {
		w := want[o.Customer]
		want[o.Customer] = [2]int64{w[0] + 1, w[1] + o.TotalCents}
	}
	rows, _ := pool.Query(ctx, `SELECT customer, orders, total_cents FROM customer_totals`)
	got := map[string][2]int64{}
	var c string
	var n, t int64
	if _, err := pgx.ForEachRow(rows, []any{&c, &n, &t}, func() error { got[c] = [2]int64{n, t}; return nil }); err != nil {
		return err
	}
	for cust, w := range want {
		if got[cust] != w {
			bad("%s: %d orders, %d cents; want %d, %d", cust, got[cust][0], got[cust][1], w[0], w[1])
		}
	}
	if len(got) != len(want) {
		bad("%d customers projected, want %d", len(got), len(want))
	}

	var ordersN, outboxN, published, distinctIDs, totalsMarkers, deadLetters int
	if err := pool.QueryRow(ctx, `SELECT
		(SELECT count(*) FROM orders),
		(SELECT count(*) FROM idem_outbox),
		(SELECT count(*) FROM idem_outbox WHERE published_at IS NOT NULL),
		(SELECT count(DISTINCT message_id) FROM idem_outbox),
		(SELECT count(*) FROM idem_markers m JOIN idem_handlers h ON h.id = m.handler_id WHERE h.name = $1),
		(SELECT count(*) FROM idem_dead_letters)`, totalsHandler).Scan(&ordersN, &outboxN, &published, &distinctIDs, &totalsMarkers, &deadLetters); err != nil {
		return err
	}
	if ordersN != len(orders) || outboxN != len(orders) || published != len(orders) || distinctIDs != len(orders) {
		bad("%d orders, %d outbox rows (%d published, %d IDs); want %d of each", ordersN, outboxN, published, distinctIDs, len(orders))
	}
	if totalsMarkers != len(orders) {
		bad("%d projection markers, want %d", totalsMarkers, len(orders))
	}
	if deadLetters != 0 {
		bad("%d dead letters, want none", deadLetters)
	}

	// One e-mail per order, under its idempotency key, never two calls
	// for one key at once.
	repeats := 0
	for _, o := range orders {
		key := idem.IdempotencyKey(emailHandler, outbox.MessageID(cfg.subject(), o.ID, 1))
		if e, ok := rep.Sent[key]; !ok || e.To != o.Email {
			bad("order %s: e-mail %+v under its key, want one to %s", o.ID, e, o.Email)
		}
		repeats += rep.Requests[key] - 1
	}
	if len(rep.Sent) != len(orders) {
		bad("%d e-mails sent, want %d", len(rep.Sent), len(orders))
	}
	if rep.Overlaps != 0 {
		bad("%d requests for a key while another for it was under way", rep.Overlaps)
	}
	for _, h := range []string{totalsHandler, emailHandler} {
		if !strings.Contains(scraped, `idem_messages_total{handler="`+h+`",outcome="applied"}`) {
			bad("/metrics has no applied count for %s", h)
		}
	}
	// Service 2 published at least the orders posted to it.
	if n, ok := metricValue(scraped, "idem_outbox_published_total"); !ok || n < 1 {
		bad("/metrics counts %v outbox rows published by service 2, want at least 1", n)
	}
	if len(problems) > 0 {
		for _, p := range problems {
			fmt.Fprintln(out, "MISMATCH", p)
		}
		return fmt.Errorf("%d mismatches", len(problems))
	}
	fmt.Fprintf(out, "verified: %d orders, %d outbox rows published, %d customer totals, %d e-mails, one per order "+
		"(%d calls repeated after a 503 or the kill, none sent twice), no dead letter, metrics served (%s)\n",
		len(orders), published, len(want), len(rep.Sent), repeats, took.Round(time.Millisecond))
	return nil
}

// metricValue returns the value of an unlabelled metric in a Prometheus
// text exposition.
func metricValue(scraped, name string) (float64, bool) {
	for _, line := range strings.Split(scraped, "\n") {
		if v, ok := strings.CutPrefix(line, name+" "); ok {
			f, err := strconv.ParseFloat(strings.TrimSpace(v), 64)
			return f, err == nil
		}
	}
	return 0, false
}

// prefixed writes each line to w with a prefix.
func prefixed(w io.Writer, prefix string) io.Writer {
	pr, pw := io.Pipe()
	go func() {
		sc := bufio.NewScanner(pr)
		for sc.Scan() {
			fmt.Fprintf(w, "%s%s\n", prefix, sc.Text())
		}
	}()
	return pw
}
