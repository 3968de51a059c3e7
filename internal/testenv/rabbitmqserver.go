package testenv

import (
	"bytes"
	"context"
	"os"
	"os/exec"
	"os/user"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"
)

// RabbitMQServer is a throwaway RabbitMQ node a test owns, so that it can
// raise a resource alarm on it without touching the shared broker. It
// takes about 5 s to start.
type RabbitMQServer struct {
	t    testing.TB
	ctl  string
	node string
	dir  string
	port int
	proc *serverProcess
}

// NewRabbitMQServer starts a RabbitMQ node on a free loopback port, its
// files in a temporary directory; it is stopped and removed when t ends.
// It skips (loudly, or fails under IDEM_REQUIRE_SERVICES=1) when
// rabbitmq-server is not installed. Run as root, the packaged scripts run
// the node as the rabbitmq user, which then owns the directory.
func NewRabbitMQServer(t testing.TB) *RabbitMQServer {
	t.Helper()
	bin, ctl := findBinary("rabbitmq-server"), findBinary("rabbitmqctl")
	if bin == "" || ctl == "" {
		Unavailable(t, "rabbitmq-server", "$PATH", os.ErrNotExist)
	}
	dir, err := os.MkdirTemp("", "idem-rabbitmq-")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = os.RemoveAll(dir) })
	if err := os.WriteFile(filepath.Join(dir, "enabled_plugins"), []byte("[].\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	if os.Geteuid() == 0 {
		if u, err := user.Lookup("rabbitmq"); err == nil {
			uid, _ := strconv.Atoi(u.Uid)
			gid, _ := strconv.Atoi(u.Gid)
			_ = os.Chmod(dir, 0o755)
			for _, p := range []string{dir, filepath.Join(dir, "enabled_plugins")} {
				if err := os.Chown(p, uid, gid); err != nil {
					t.Fatal(err)
				}
			}
		}
	}
	port := freePort(t)
	s := &RabbitMQServer{t: t, ctl: ctl, node: "idemtest" + strconv.Itoa(port) + "@localhost", dir: dir, port: port}
	cmd := exec.Command(bin)
	cmd.Env = append(os.Environ(),
		"RABBITMQ_NODENAME="+s.node,
		"RABBITMQ_NODE_IP_ADDRESS=127.0.0.1",
		"RABBITMQ_NODE_PORT="+strconv.Itoa(port),
		"RABBITMQ_DIST_PORT="+strconv.Itoa(freePort(t)),
		"RABBITMQ_MNESIA_BASE="+filepath.Join(dir, "mnesia"),
		"RABBITMQ_LOG_BASE="+filepath.Join(dir, "log"),
		"RABBITMQ_ENABLED_PLUGINS_FILE="+filepath.Join(dir, "enabled_plugins"),
		"RABBITMQ_CONFIG_FILE="+filepath.Join(dir, "none"),
	)
	logPath := filepath.Join(dir, "server.log")
	out, err := os.Create(logPath)
	if err != nil {
		t.Fatal(err)
	}
	defer out.Close()
	cmd.Stdout, cmd.Stderr = out, out
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	t.Cleanup(s.stop)
	s.proc = startServer(t, cmd, logPath, 60*time.Second, func(context.Context) error {
		c, err := amqp.DialConfig(s.URL(), amqp.Config{Dial: amqp.DefaultDial(time.Second)})
		if err != nil {
			return err
		}
		return c.Close()
	})
	return s
}

// URL is the node's AMQP URI (guest/guest, the default vhost).
func (s *RabbitMQServer) URL() string {
	return "amqp://guest:guest@127.0.0.1:" + strconv.Itoa(s.port) + "/"
}

// DeclareQueue declares a durable classic queue named name on the node.
func (s *RabbitMQServer) DeclareQueue(name string) {
	s.t.Helper()
	s.channel(func(ch *amqp.Channel) error {
		_, err := ch.QueueDeclare(name, true, false, false, false, nil)
		return err
	})
}

// Bind binds the queue named queue to exchange with routing key key.
func (s *RabbitMQServer) Bind(queue, exchange, key string) {
	s.t.Helper()
	s.channel(func(ch *amqp.Channel) error { return ch.QueueBind(queue, key, exchange, false, nil) })
}

// AddUser adds a user of the default vhost with password pass and the
// permissions configure, write and read (regular expressions of resource
// names, rabbitmqctl set_permissions), and returns its AMQP URI.
func (s *RabbitMQServer) AddUser(name, pass, configure, write, read string) string {
	s.t.Helper()
	s.rabbitmqctl("add_user", name, pass)
	s.rabbitmqctl("set_permissions", "-p", "/", name, configure, write, read)
	return "amqp://" + name + ":" + pass + "@127.0.0.1:" + strconv.Itoa(s.port) + "/"
}

// Messages returns how many messages the queue named name holds ready.
func (s *RabbitMQServer) Messages(name string) int {
	s.t.Helper()
	var n int
	s.channel(func(ch *amqp.Channel) error {
		q, err := ch.QueueDeclarePassive(name, true, false, false, false, nil)
		n = q.Messages
		return err
	})
	return n
}

// channel runs f on a channel of a new connection to the node.
func (s *RabbitMQServer) channel(f func(*amqp.Channel) error) {
	s.t.Helper()
	conn, err := amqp.Dial(s.URL())
	if err != nil {
		s.t.Fatal(err)
	}
	defer conn.Close()
	ch, err := conn.Channel()
	if err == nil {
		err = f(ch)
	}
	if err != nil {
		s.t.Fatal(err)
	}
}

// MemoryAlarm raises the node's memory alarm (on) or clears it: the node
// then blocks, or unblocks, its publishing connections. It returns once
// rabbitmqctl has set the watermark.
func (s *RabbitMQServer) MemoryAlarm(on bool) {
	s.t.Helper()
	mark := "0.8" // above the default (0.4, 0.6 since RabbitMQ 4): no alarm on a test's load
	if on {
		mark = "0.000001"
	}
	s.rabbitmqctl("set_vm_memory_high_watermark", mark)
}

func (s *RabbitMQServer) rabbitmqctl(args ...string) {
	s.t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	out, err := exec.CommandContext(ctx, s.ctl, append([]string{"-n", s.node}, args...)...).CombinedOutput()
	if err != nil {
		s.t.Fatalf("rabbitmqctl %s: %v\n%s", strings.Join(args, " "), err, out)
	}
}

// stop stops the node, and kills what is left of it (the packaged
// scripts start it under another process, which a kill of the one
// started here would not reach).
func (s *RabbitMQServer) stop() {
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	_ = exec.CommandContext(ctx, s.ctl, "-n", s.node, "stop").Run()
	s.proc.kill()
	// Whatever still names the node (the Erlang VM, its helpers).
	entries, _ := os.ReadDir("/proc")
	for _, e := range entries {
		pid, err := strconv.Atoi(e.Name())
		if err != nil {
			continue
		}
		cmdline, err := os.ReadFile(filepath.Join("/proc", e.Name(), "cmdline"))
		if err == nil && bytes.Contains(cmdline, []byte(s.node)) {
			_ = syscall.Kill(pid, syscall.SIGKILL)
		}
	}
}
