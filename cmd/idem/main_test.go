package main

import (
	"bytes"
	"context"
	"errors"
	"strings"
	"testing"
)

// runCLI runs the command line args with an empty environment and returns
// the exit code and both outputs.
func runCLI(t *testing.T, args ...string) (code int, stdout, stderr string) {
	t.Helper()
	return runCLIEnv(t, map[string]string{}, args...)
}

// runCLIEnv is runCLI with the given environment variables.
func runCLIEnv(t *testing.T, vars map[string]string, args ...string) (code int, stdout, stderr string) {
	t.Helper()
	var out, errOut bytes.Buffer
	e := &env{stdout: &out, stderr: &errOut, getenv: func(k string) string { return vars[k] }}
	code = runEnv(context.Background(), e, args)
	return code, out.String(), errOut.String()
}

// TestHelpDocumentsCommandsAndExitCodes checks that the top-level help lists the commands and the exit codes.
func TestHelpDocumentsCommandsAndExitCodes(t *testing.T) {
	t.Parallel()
	for _, args := range [][]string{{"help"}, {"--help"}, {"-h"}, {"help", "--help"}, {"help", "-h"}} {
		code, out, _ := runCLI(t, args...)
		if code != exitOK {
			t.Errorf("idem %s: exit %d, want 0", strings.Join(args, " "), code)
		}
		for _, want := range []string{"Usage:", "demo", "migrate", "Exit codes:", "0  success", "1  verification or operation failed", "2  usage error"} {
			if !strings.Contains(out, want) {
				t.Errorf("idem %s: output lacks %q:\n%s", strings.Join(args, " "), want, out)
			}
		}
	}
}

// TestCommandHelp checks every form of a command's help: exit 0, flags and exit codes shown.
func TestCommandHelp(t *testing.T) {
	t.Parallel()
	for _, c := range commands() {
		for _, args := range [][]string{{c.name, "--help"}, {c.name, "-h"}, {"help", c.name}} {
			code, out, errOut := runCLI(t, args...)
			if code != exitOK {
				t.Errorf("idem %s: exit %d, want 0; stderr: %s", strings.Join(args, " "), code, errOut)
			}
			for _, want := range []string{"Usage: idem " + c.name, "Flags:", "Exit codes:"} {
				if !strings.Contains(out, want) {
					t.Errorf("idem %s: output lacks %q:\n%s", strings.Join(args, " "), want, out)
				}
			}
		}
	}
}

// TestUsageErrors checks that command-line mistakes exit 2 with a helpful message.
func TestUsageErrors(t *testing.T) {
	t.Parallel()
	tests := []struct {
		name string
		args []string
		want string // in stderr
	}{
		{"no command", nil, "Usage:"},
		{"unknown command", []string{"frobnicate"}, `unknown command "frobnicate"`},
		{"help for unknown command", []string{"help", "frobnicate"}, `unknown command "frobnicate"`},
		{"help with two arguments", []string{"help", "demo", "migrate"}, "too many arguments"},
		{"undefined flag", []string{"demo", "--no-such-flag"}, "flag provided but not defined"},
		{"bad flag value", []string{"demo", "--events", "many"}, "invalid value"},
		{"positional argument", []string{"demo", "extra"}, `unexpected argument "extra"`},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			code, _, errOut := runCLI(t, tc.args...)
			if code != exitUsage {
				t.Errorf("exit %d, want %d; stderr: %s", code, exitUsage, errOut)
			}
			if !strings.Contains(errOut, tc.want) {
				t.Errorf("stderr lacks %q:\n%s", tc.want, errOut)
			}
		})
	}
}

// TestRunUsesProcessEnvironment checks run, the entry point main uses.
func TestRunUsesProcessEnvironment(t *testing.T) {
	t.Parallel()
	var out, errOut bytes.Buffer
	if code := run(context.Background(), []string{"help"}, &out, &errOut); code != exitOK {
		t.Fatalf("exit %d, want 0; stderr: %s", code, errOut.String())
	}
	if !strings.Contains(out.String(), "Commands:") {
		t.Errorf("help output lacks the command list:\n%s", out.String())
	}
}

// TestCommandNamesAreUnique guards the command table against duplicate or incomplete entries.
func TestCommandNamesAreUnique(t *testing.T) {
	t.Parallel()
	seen := map[string]bool{"help": true}
	for _, c := range commands() {
		if seen[c.name] {
			t.Errorf("command %q defined twice (or shadows help)", c.name)
		}
		seen[c.name] = true
		if c.summary == "" || c.help == "" || c.setup == nil {
			t.Errorf("command %q lacks a summary, help or setup", c.name)
		}
	}
}

// A failure reads "idem import: read …": the library's "idem: " and the
// command's name, which the line starts with, are not said twice.
func TestErrorTextDropsRepeatedPrefixes(t *testing.T) {
	for _, c := range []struct{ cmd, err, want string }{
		{"import", "idem: import: read t.c: boom", "read t.c: boom"},
		{"import", "idem: handler name: empty", "handler name: empty"},
		{"migrate", "postgres: migrate: boom", "postgres: migrate: boom"},
		{"dlq", "import: idem: x", "import: idem: x"},
	} {
		if got := errorText(c.cmd, errors.New(c.err)); got != c.want {
			t.Errorf("errorText(%q, %q) = %q, want %q", c.cmd, c.err, got, c.want)
		}
	}
}
