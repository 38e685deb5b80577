package api

import (
	"syscall"
	"time"
)

// burn spins until the calling thread has spent d of CPU time (onThreadCPU
// runs its function on one locked thread).
func burn(d time.Duration) {
	var r syscall.Rusage
	cpu := func() time.Duration {
		_ = syscall.Getrusage(1, &r) // RUSAGE_THREAD
		return time.Duration(r.Utime.Nano() + r.Stime.Nano())
	}
	for start := cpu(); cpu()-start < d; {
	}
}
