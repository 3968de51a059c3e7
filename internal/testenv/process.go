package testenv

import (
	"context"
	"net"
	"os"
	"os/exec"
	"path/filepath"
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

// freePort returns a TCP port free on the loopback interface just now.
func freePort(t testing.TB) int {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	return l.Addr().(*net.TCPAddr).Port
}
