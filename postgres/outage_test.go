package postgres_test

import (
	"context"
	"fmt"
	"net"
	"os"
	"os/exec"
	"os/user"
	"path/filepath"
	"strconv"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemhq/idem"
	"github.com/idemhq/idem/idemtest"
	"github.com/idemhq/idem/internal/testenv"
)

// cluster is a throwaway PostgreSQL server the test owns, so it can stop
// it while messages flow.
type cluster struct {
	t          *testing.T
	bin, dir   string
	data, sock string
	port       int
}

// newCluster runs initdb in a temporary directory and starts the server
// on a free port. It skips (loudly, or fails under IDEM_REQUIRE_SERVICES=1)
// when the PostgreSQL binaries are not installed.
func newCluster(t *testing.T) *cluster {
	t.Helper()
	bins, _ := filepath.Glob("/usr/lib/postgresql/*/bin/pg_ctl")
	if len(bins) == 0 {
		testenv.Unavailable(t, "PostgreSQL server binaries (initdb, pg_ctl)", "/usr/lib/postgresql/*/bin", os.ErrNotExist)
	}
	dir, err := os.MkdirTemp("", "idem-pg-")
	if err != nil {
		t.Fatal(err)
	}
	c := &cluster{t: t, bin: filepath.Dir(bins[len(bins)-1]), dir: dir, data: filepath.Join(dir, "data"), sock: dir}
	t.Cleanup(func() {
		c.pgctl("stop", "-m", "immediate")
		os.RemoveAll(dir)
	})
	if err := os.Chmod(dir, 0o777); err != nil {
		t.Fatal(err)
	}
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	c.port = l.Addr().(*net.TCPAddr).Port
	l.Close()
	if out, err := c.run("initdb", "-D", c.data, "-A", "trust", "-U", "postgres", "--no-sync"); err != nil {
		t.Fatalf("initdb: %v\n%s", err, out)
	}
	c.start()
	return c
}

// run runs a PostgreSQL binary, as the postgres user when the test runs as
// root (the server refuses to run as root).
func (c *cluster) run(name string, args ...string) ([]byte, error) {
	path := filepath.Join(c.bin, name)
	var cmd *exec.Cmd
	if u, err := user.Current(); err == nil && u.Uid == "0" {
		cmd = exec.Command("runuser", append([]string{"-u", "postgres", "--", path}, args...)...)
	} else {
		cmd = exec.Command(path, args...)
	}
	return cmd.CombinedOutput()
}

func (c *cluster) pgctl(args ...string) ([]byte, error) {
	return c.run("pg_ctl", append([]string{"-D", c.data, "-w"}, args...)...)
}

func (c *cluster) start() {
	c.t.Helper()
	opts := fmt.Sprintf("-p %d -k %s -c listen_addresses=127.0.0.1 -c fsync=on -c max_connections=30", c.port, c.sock)
	if out, err := c.pgctl("start", "-l", filepath.Join(c.dir, "log"), "-o", opts); err != nil {
		c.t.Fatalf("pg_ctl start: %v\n%s", err, out)
	}
}

// crash stops the server as a crash would: no checkpoint, recovery from the
// WAL at the next start.
func (c *cluster) crash() {
	c.t.Helper()
	if out, err := c.pgctl("stop", "-m", "immediate"); err != nil {
		c.t.Fatalf("pg_ctl stop: %v\n%s", err, out)
	}
}

func (c *cluster) dsn() string {
	return "postgres://postgres@127.0.0.1:" + strconv.Itoa(c.port) + "/postgres?sslmode=disable&connect_timeout=2"
}

// TestDatabaseOutage crashes the database while four workers process a
// stream with redeliveries, then restarts it. A worker acknowledges a
// delivery only after Process returned an outcome; an error leaves it
// unacknowledged and it is delivered again later, as a broker would. No
// acknowledged delivery may lack its marker after the restart, processing
// resumes without intervention, and the final balances equal the unique
// intended events.
func TestDatabaseOutage(t *testing.T) {
	c := newCluster(t)
	ctx := context.Background()
	pool, err := pgxpool.New(ctx, c.dsn())
	if err != nil {
		t.Fatal(err)
	}
	defer pool.Close()
	s := storeIn(t, pool, "app")
	p, err := idem.NewProcessor(s.Driver, nil)
	if err != nil {
		t.Fatal(err)
	}
	var calls sync.Map
	h := idemtest.CreditHandler(s, "balances", &calls)

	events := idemtest.Events(3000)
	queue := make(chan int, 2*len(events))
	for i := range events {
		queue <- i
	}
	var (
		acked     sync.Map // message ID → true once acknowledged
		nacked    atomic.Int64
		ackCount  atomic.Int64
		redeliver atomic.Int64
		wg        sync.WaitGroup
	)
	done := make(chan struct{})
	for w := range 4 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for {
				var i int
				select {
				case <-done:
					return
				case i = <-queue:
				}
				e := events[i]
				out, err := p.Process(ctx, h, e.Message())
				if err != nil {
					nacked.Add(1)
					time.Sleep(20 * time.Millisecond) // the broker's redelivery delay
					queue <- i
					continue
				}
				if out != idem.Applied && out != idem.Duplicate {
					t.Errorf("worker %d: %s: outcome %v", w, e.ID, out)
				}
				if _, again := acked.LoadOrStore(e.ID, true); !again {
					if ackCount.Add(1) == int64(len(events)) {
						close(done)
					}
					if i%10 == 0 {
						redeliver.Add(1)
						queue <- i // an at-least-once broker redelivers some acknowledged messages
					}
				}
			}
		}()
	}

	for ackCount.Load() < int64(len(events))/3 {
		time.Sleep(5 * time.Millisecond)
	}
	c.crash()
	ackedAtCrash := ackCount.Load()
	time.Sleep(1500 * time.Millisecond)
	errorsDuringOutage := nacked.Load()
	c.start()
	select {
	case <-done:
	case <-time.After(60 * time.Second):
		t.Fatalf("processing did not resume: %d of %d acknowledged", ackCount.Load(), len(events))
	}
	wg.Wait()
	t.Logf("crash after %d acknowledgements; %d deliveries failed and were redelivered; %d acknowledged messages redelivered",
		ackedAtCrash, nacked.Load(), redeliver.Load())
	if errorsDuringOutage == 0 {
		t.Fatal("no delivery failed while the database was down: the outage was not exercised")
	}
	n, err := s.Markers(ctx, "balances")
	if err != nil {
		t.Fatal(err)
	}
	if n != len(events) {
		t.Fatalf("%d markers after the restart, want %d: an acknowledged delivery lost its outcome", n, len(events))
	}
	balances, err := s.Balances(ctx)
	if err != nil {
		t.Fatal(err)
	}
	for acct, want := range idemtest.Expected(events) {
		if balances[acct] != want {
			t.Fatalf("%s = %d, want %d", acct, balances[acct], want)
		}
	}
}
