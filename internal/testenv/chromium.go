package testenv

import (
	"errors"
	"os"
	"os/exec"
	"testing"
)

// Chromium returns the path of the Chromium browser: IDEM_CHROMIUM, else
// chromium (or chromium-browser) on the PATH. Without one the test is
// skipped loudly, or fails under IDEM_REQUIRE_SERVICES=1 (.ci/run installs
// Debian's chromium package when it is missing).
func Chromium(t testing.TB) string {
	t.Helper()
	if p := os.Getenv("IDEM_CHROMIUM"); p != "" {
		if _, err := os.Stat(p); err != nil {
			Unavailable(t, "Chromium", p, err)
		}
		return p
	}
	for _, name := range []string{"chromium", "chromium-browser"} {
		if p, err := exec.LookPath(name); err == nil {
			return p
		}
	}
	Unavailable(t, "Chromium", "$PATH", errors.New("no chromium: apt-get install chromium, or set IDEM_CHROMIUM"))
	return ""
}
