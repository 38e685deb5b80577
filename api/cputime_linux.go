package api

import (
	"runtime"
	"syscall"
	"time"
)

// onThreadCPU runs fn on one OS thread and returns the CPU time that thread
// spent on it: what fn costs, whatever else the machine is doing.
func onThreadCPU(fn func() error) (time.Duration, error) {
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	var before, after syscall.Rusage
	const rusageThread = 1 // RUSAGE_THREAD
	if syscall.Getrusage(rusageThread, &before) != nil {
		start := time.Now()
		err := fn()
		return time.Since(start), err
	}
	err := fn()
	_ = syscall.Getrusage(rusageThread, &after)
	cpu := func(r *syscall.Rusage) time.Duration {
		return time.Duration(r.Utime.Nano() + r.Stime.Nano())
	}
	return cpu(&after) - cpu(&before), err
}
