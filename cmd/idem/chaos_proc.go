package main

import (
	"encoding/json"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"sync"
	"time"
)

// chaosChild is what a child process of a chaos run is told to be, passed
// as JSON in chaosChildEnv.
type chaosChild struct {
	// Role is node, consumer or relay.
	Role string `json:"role"`
	// Name identifies the process in logs, reports and lease owners.
	Name string `json:"name"`
	// Broker is nats or kafka.
	Broker string `json:"broker"`
	// URLs are the NATS client URLs or the Kafka seed brokers.
	URLs []string `json:"urls"`

	// Index, ClientPorts, RoutePorts and StoreDir describe a NATS node:
	// its place in the cluster, every node's client and route port, and
	// its JetStream directory.
	Index       int    `json:"index,omitempty"`
	ClientPorts []int  `json:"client_ports,omitempty"`
	RoutePorts  []int  `json:"route_ports,omitempty"`
	StoreDir    string `json:"store_dir,omitempty"`

	// DSN and Schema locate the Postgres store of a consumer or relay.
	DSN    string `json:"dsn,omitempty"`
	Schema string `json:"schema,omitempty"`
	// Stream is the JetStream stream or the Kafka topic.
	Stream string `json:"stream,omitempty"`
	// SinkURL is the coordinator's HTTP server: the lease handler's sink
	// and the consumers' reports.
	SinkURL string `json:"sink_url,omitempty"`
}

// chaosProc is one child process of a chaos run, which the run kills and
// starts again.
type chaosProc struct {
	name    string
	spec    chaosChild
	logPath string

	mu      sync.Mutex
	cmd     *exec.Cmd
	stdin   io.WriteCloser
	exited  chan struct{}
	killed  bool // by the run: SIGKILL or stop
	running bool
}

// chaosProcs starts and stops the children of a run and notes any that
// dies without being killed.
type chaosProcs struct {
	exe, dir string

	mu         sync.Mutex
	unexpected []string
}

// newProc describes a child; start runs it.
func (ps *chaosProcs) newProc(spec chaosChild) *chaosProc {
	return &chaosProc{name: spec.Name, spec: spec, logPath: filepath.Join(ps.dir, spec.Name+".log")}
}

// start runs p, its output appended to its log, its standard input a pipe
// whose closing tells it the run is over.
func (ps *chaosProcs) start(p *chaosProc) error {
	spec, err := json.Marshal(p.spec)
	if err != nil {
		return err
	}
	logf, err := os.OpenFile(p.logPath, os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o644)
	if err != nil {
		return fmt.Errorf("chaos: log of %s: %w", p.name, err)
	}
	defer logf.Close()
	fmt.Fprintf(logf, "--- start %s\n", time.Now().UTC().Format(time.RFC3339Nano))
	cmd := exec.Command(ps.exe, "chaos")
	cmd.Env = append(os.Environ(), chaosChildEnv+"="+string(spec))
	cmd.Stdout, cmd.Stderr = logf, logf
	stdin, err := cmd.StdinPipe()
	if err != nil {
		return err
	}
	if err := cmd.Start(); err != nil {
		return fmt.Errorf("chaos: start %s: %w", p.name, err)
	}
	exited := make(chan struct{})
	p.mu.Lock()
	p.cmd, p.stdin, p.exited, p.killed, p.running = cmd, stdin, exited, false, true
	p.mu.Unlock()
	go func() {
		err := cmd.Wait()
		p.mu.Lock()
		killed := p.killed
		p.running = false
		p.mu.Unlock()
		if !killed {
			ps.mu.Lock()
			ps.unexpected = append(ps.unexpected, fmt.Sprintf("%s exited on its own (%v); see %s", p.name, err, p.logPath))
			ps.mu.Unlock()
		}
		close(exited)
	}()
	return nil
}

// kill sends SIGKILL to p and waits until it is gone.
func (p *chaosProc) kill() {
	p.mu.Lock()
	if !p.running {
		p.mu.Unlock()
		return
	}
	p.killed = true
	cmd, exited := p.cmd, p.exited
	p.mu.Unlock()
	_ = cmd.Process.Kill() // SIGKILL: no handler runs, nothing is flushed
	<-exited
}

// stop asks p to end by closing its standard input, and kills it if it
// has not ended within five seconds.
func (p *chaosProc) stop() {
	p.mu.Lock()
	if !p.running {
		p.mu.Unlock()
		return
	}
	p.killed = true
	stdin, exited := p.stdin, p.exited
	p.mu.Unlock()
	_ = stdin.Close()
	select {
	case <-exited:
	case <-time.After(5 * time.Second):
		p.kill()
	}
}

// died lists the children that ended without being killed.
func (ps *chaosProcs) died() []string {
	ps.mu.Lock()
	defer ps.mu.Unlock()
	return append([]string(nil), ps.unexpected...)
}
