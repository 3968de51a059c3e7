package mysql_test

import (
	"testing"

	"github.com/idemhq/idem/driver"
	"github.com/idemhq/idem/idemtest"
	"github.com/idemhq/idem/internal/testenv"
	"github.com/idemhq/idem/mysql"
)

// attachLeaseStore opens a driver on the database at dsn; crash tests open
// it from two processes.
func attachLeaseStore(t testing.TB, dsn string) driver.LeaseDriver {
	t.Helper()
	drv, err := mysql.New(testenv.MySQL(t, dsn, 40), nil)
	if err != nil {
		t.Fatal(err)
	}
	return drv
}

func createLeaseStore(t testing.TB) (driver.LeaseDriver, string) {
	t.Helper()
	dsn := testenv.MySQLDatabase(t)
	drv := attachLeaseStore(t, dsn)
	if err := drv.(*mysql.Driver).Migrate(t.Context()); err != nil {
		t.Fatal(err)
	}
	return drv, dsn
}

func openLeaseStore(t testing.TB) driver.LeaseDriver {
	t.Helper()
	drv, _ := createLeaseStore(t)
	return drv
}

func TestLease(t *testing.T) {
	t.Parallel()
	idemtest.RunLease(t, &idemtest.LeaseHarness{Open: openLeaseStore, Workers: 16, IDs: 500})
}

func leaseCrashHarness() *idemtest.LeaseCrashHarness {
	return &idemtest.LeaseCrashHarness{Create: createLeaseStore, Attach: attachLeaseStore, ChildTest: "TestLeaseCrashChild"}
}

// TestLeaseCrash kills a worker process at every crash point, on a
// database both processes use.
func TestLeaseCrash(t *testing.T) { idemtest.RunLeaseCrash(t, leaseCrashHarness()) }

// TestLeaseCrashChild is the killed worker of TestLeaseCrash; run on its
// own it does nothing.
func TestLeaseCrashChild(t *testing.T) { idemtest.LeaseCrashChild(t, leaseCrashHarness()) }
