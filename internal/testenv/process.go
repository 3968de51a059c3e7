package testenv

import (
	"context"
	"math/rand/v2"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"
)

// serverProcess is a server a test started as a child process and may
// kill.
type serverProcess struct {
	cmd    *exec.Cmd
	exited chan struct{}
}

// startServer starts cmd and returns once ready succeeds, probing every
// 20 ms, each probe bounded by a second. It fails t, with the server's log
// at logPath, if the process exits first or is not ready within wait.
func startServer(t testing.TB, cmd *exec.Cmd, logPath string, wait time.Duration, ready func(context.Context) error) *serverProcess {
	t.Helper()
	name := filepath.Base(cmd.Path)
	if err := cmd.Start(); err != nil {
		t.Fatalf("start %s: %v", name, err)
	}
	p := &serverProcess{cmd: cmd, exited: make(chan struct{})}
	go func() {
		_ = cmd.Wait()
		close(p.exited)
	}()
	deadline := time.Now().Add(wait)
	for {
		ctx, cancel := context.WithTimeout(context.Background(), time.Second)
		err := ready(ctx)
		cancel()
		if err == nil {
			return p
		}
		select {
		case <-p.exited:
			log, _ := os.ReadFile(logPath)
			t.Fatalf("%s exited at start: %s", name, log)
		default:
		}
		if time.Now().After(deadline) {
			p.kill()
			t.Fatalf("%s did not answer within %s: %v", name, wait, err)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// kill kills the process (SIGKILL) and waits for it to end. A nil process
// is nothing to kill.
func (p *serverProcess) kill() {
	if p == nil {
		return
	}
	_ = p.cmd.Process.Kill()
	<-p.exited
}

// freePort returns a TCP port free on the loopback interface just now,
// below the kernel's range of ephemeral ports. A port the kernel hands out
// (port 0) is one of those: any client connection the tests open may take
// it before a server started on it binds, or while it is down between a
// crash and a restart ("Address already in use"). Below that range only
// another listener can.
func freePort(t testing.TB) int {
	t.Helper()
	low := 32768
	if b, err := os.ReadFile("/proc/sys/net/ipv4/ip_local_port_range"); err == nil {
		if f := strings.Fields(string(b)); len(f) == 2 {
			if n, err := strconv.Atoi(f[0]); err == nil && n > 11000 {
				low = n
			}
		}
	}
	for range 100 {
		port := 10000 + rand.IntN(low-10000)
		l, err := net.Listen("tcp", "127.0.0.1:"+strconv.Itoa(port))
		if err != nil {
			continue
		}
		l.Close()
		return port
	}
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	return l.Addr().(*net.TCPAddr).Port
}
