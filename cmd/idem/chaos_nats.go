package main

import (
	"context"
	"errors"
	"fmt"
	"net"
	"path/filepath"
	"strings"
	"time"

	"github.com/nats-io/nats-server/v2/server"
	"github.com/nats-io/nats.go"
	natsjs "github.com/nats-io/nats.go/jetstream"
)

// chaosClusterNodes is the size of the JetStream cluster, and the stream's
// replica count.
const chaosClusterNodes = 3

// chaosStream and chaosSubject are the run's JetStream stream and the
// subject the producer writes its events to.
const (
	chaosStream  = "CHAOS"
	chaosSubject = "chaos.events"
)

// runChaosNode runs one node of the run's JetStream cluster: the embedded
// server, with routes to the other nodes on loopback ports and its stream
// data in spec.StoreDir, which a restart finds again.
func runChaosNode(ctx context.Context, spec *chaosChild) error {
	var routes []string
	for i, p := range spec.RoutePorts {
		if i != spec.Index {
			routes = append(routes, fmt.Sprintf("nats://127.0.0.1:%d", p))
		}
	}
	opts := &server.Options{
		ServerName: spec.Name,
		Host:       "127.0.0.1",
		Port:       spec.ClientPorts[spec.Index],
		JetStream:  true,
		StoreDir:   spec.StoreDir,
		NoSigs:     true,
		Logtime:    true,
		Cluster:    server.ClusterOpts{Name: "idem-chaos", Host: "127.0.0.1", Port: spec.RoutePorts[spec.Index]},
		Routes:     server.RoutesFromStr(strings.Join(routes, ",")),
	}
	ns, err := server.NewServer(opts)
	if err != nil {
		return fmt.Errorf("chaos: node %s: %w", spec.Name, err)
	}
	ns.ConfigureLogger()
	go ns.Start()
	if !ns.ReadyForConnections(30 * time.Second) {
		ns.Shutdown()
		return fmt.Errorf("chaos: node %s did not accept connections within 30s", spec.Name)
	}
	<-ctx.Done()
	ns.Shutdown()
	return nil
}

// freePorts returns n loopback ports that were free a moment ago.
func freePorts(n int) ([]int, error) {
	var ls []net.Listener
	defer func() {
		for _, l := range ls {
			l.Close()
		}
	}()
	ports := make([]int, n)
	for i := range ports {
		l, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			return nil, err
		}
		ls = append(ls, l)
		ports[i] = l.Addr().(*net.TCPAddr).Port
	}
	return ports, nil
}

// chaosNATS is the run's JetStream cluster: three node processes and the
// run's own connection to them.
type chaosNATS struct {
	nodeProcs  []*chaosProc
	clientURLs []string
	nc         *nats.Conn
	js         natsjs.JetStream
	streamName string
}

// newChaosNATS starts the cluster's nodes, waits for it to form and
// creates the R3 stream.
func newChaosNATS(ctx context.Context, procs *chaosProcs) (*chaosNATS, error) {
	ports, err := freePorts(2 * chaosClusterNodes)
	if err != nil {
		return nil, fmt.Errorf("chaos: ports for the cluster: %w", err)
	}
	c := &chaosNATS{streamName: chaosStream}
	clientPorts, routePorts := ports[:chaosClusterNodes], ports[chaosClusterNodes:]
	for i := range chaosClusterNodes {
		c.clientURLs = append(c.clientURLs, fmt.Sprintf("nats://127.0.0.1:%d", clientPorts[i]))
	}
	for i := range chaosClusterNodes {
		name := fmt.Sprintf("node-%d", i)
		p := procs.newProc(chaosChild{Role: "node", Name: name, Broker: "nats", Index: i,
			ClientPorts: clientPorts, RoutePorts: routePorts, StoreDir: filepath.Join(procs.dir, name)})
		if err := procs.start(p); err != nil {
			c.close()
			return nil, err
		}
		c.nodeProcs = append(c.nodeProcs, p)
	}
	if c.nc, c.js, err = chaosConnectNATS(c.clientURLs); err != nil {
		c.close()
		return nil, err
	}
	if err := c.createStream(ctx); err != nil {
		c.close()
		return nil, err
	}
	return c, nil
}

// createStream creates an R3 stream, retrying while the cluster elects its
// leaders.
func (c *chaosNATS) createStream(ctx context.Context) error {
	deadline := time.Now().Add(time.Minute)
	for {
		sctx, cancel := context.WithTimeout(ctx, 5*time.Second)
		_, err := c.js.CreateOrUpdateStream(sctx, natsjs.StreamConfig{Name: c.streamName, Subjects: []string{chaosSubject}, Replicas: chaosClusterNodes})
		cancel()
		if err == nil {
			return nil
		}
		if ctx.Err() != nil || time.Now().After(deadline) {
			return fmt.Errorf("chaos: create the R%d stream %s: %w", chaosClusterNodes, c.streamName, err)
		}
		sleepCtx(ctx, 250*time.Millisecond)
	}
}

func (c *chaosNATS) describe() string {
	return fmt.Sprintf("a %d-node NATS JetStream cluster (%s), R%d stream %s", chaosClusterNodes, strings.Join(c.clientURLs, ","), chaosClusterNodes, c.streamName)
}

func (c *chaosNATS) urls() []string      { return c.clientURLs }
func (c *chaosNATS) stream() string      { return c.streamName }
func (c *chaosNATS) subject() string     { return chaosSubject }
func (c *chaosNATS) nodes() []*chaosProc { return c.nodeProcs }

// leader returns the name of the node leading the stream, or "".
func (c *chaosNATS) leader(ctx context.Context) string {
	info, err := c.streamInfo(ctx)
	if err != nil || info.Cluster == nil {
		return ""
	}
	return info.Cluster.Leader
}

func (c *chaosNATS) streamInfo(ctx context.Context) (*natsjs.StreamInfo, error) {
	ctx, cancel := context.WithTimeout(ctx, 2*time.Second)
	defer cancel()
	s, err := c.js.Stream(ctx, c.streamName)
	if err != nil {
		return nil, err
	}
	return s.Info(ctx)
}

// healthy reports whether the stream and its durables have a leader and
// every replica is current: only then may a node die without costing the
// quorum.
func (c *chaosNATS) healthy(ctx context.Context) bool {
	info, err := c.streamInfo(ctx)
	if err != nil || !clusterCurrent(info.Cluster) {
		return false
	}
	for _, h := range chaosHandlers {
		cctx, cancel := context.WithTimeout(ctx, 2*time.Second)
		ci, err := c.js.Consumer(cctx, c.streamName, chaosDurable(h))
		var inf *natsjs.ConsumerInfo
		if err == nil {
			inf, err = ci.Info(cctx)
		}
		cancel()
		if errors.Is(err, natsjs.ErrConsumerNotFound) {
			continue
		}
		if err != nil || !clusterCurrent(inf.Cluster) {
			return false
		}
	}
	return true
}

func clusterCurrent(ci *natsjs.ClusterInfo) bool {
	if ci == nil || ci.Leader == "" || len(ci.Replicas) != chaosClusterNodes-1 {
		return false
	}
	for _, r := range ci.Replicas {
		if !r.Current || r.Offline {
			return false
		}
	}
	return true
}

// waitNode waits until the restarted node p accepts connections.
func (c *chaosNATS) waitNode(ctx context.Context, p *chaosProc) error {
	url := c.clientURLs[p.spec.Index]
	deadline := time.Now().Add(30 * time.Second)
	for {
		nc, err := nats.Connect(url, nats.Timeout(time.Second))
		if err == nil {
			nc.Close()
			return nil
		}
		if ctx.Err() != nil || time.Now().After(deadline) {
			return fmt.Errorf("chaos: %s did not come back within 30s: %w", p.name, err)
		}
		sleepCtx(ctx, 100*time.Millisecond)
	}
}

func (c *chaosNATS) close() {
	if c.nc != nil {
		c.nc.Close()
	}
	for _, p := range c.nodeProcs {
		p.stop()
	}
}

// chaosDurable is the JetStream durable of a chaos handler.
func chaosDurable(handler string) string { return strings.ReplaceAll(handler, ".", "-") }
