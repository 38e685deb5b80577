package api

import (
	"syscall"
	"time"
)

// threadCPU is the CPU time the calling OS thread has spent; false where it
// cannot be read.
func threadCPU() (time.Duration, bool) {
	const rusageThread = 1 // RUSAGE_THREAD
	var r syscall.Rusage
	if syscall.Getrusage(rusageThread, &r) != nil {
		return 0, false
	}
	return time.Duration(r.Utime.Nano() + r.Stime.Nano()), true
}
