//go:build !unix

package idemtest

import "testing"

// RunLeaseCrash needs Unix signals to kill a child process: on this
// platform it skips.
func RunLeaseCrash(t *testing.T, h *LeaseCrashHarness) {
	t.Skip("lease crash tests need a Unix platform (SIGKILL of a child process)")
}

// LeaseCrashChild does nothing on this platform.
func LeaseCrashChild(t *testing.T, h *LeaseCrashHarness) {}

// RunAtomicCrash needs Unix signals to kill a child process: on this
// platform it skips.
func RunAtomicCrash[TTx any](t *testing.T, h *AtomicCrashHarness[TTx]) {
	t.Skip("atomic crash tests need a Unix platform (SIGKILL of a child process)")
}

// AtomicCrashChild does nothing on this platform.
func AtomicCrashChild[TTx any](t *testing.T, h *AtomicCrashHarness[TTx]) {}
