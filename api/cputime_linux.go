package api

import (
	"runtime"
	"syscall"
	"time"
)

// onThreadCPU runs fn on one OS thread and returns the CPU time that thread
// spent on it: what fn costs, whatever else the machine is doing (its wall
// time where the thread's usage cannot be read).
func onThreadCPU(fn func() error) (time.Duration, error) {
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	const rusageThread = 1 // RUSAGE_THREAD
	var before, after syscall.Rusage
	start := time.Now()
	errBefore := syscall.Getrusage(rusageThread, &before)
	err := fn()
	wall := time.Since(start)
	if errBefore != nil || syscall.Getrusage(rusageThread, &after) != nil {
		return wall, err
	}
	cpu := func(r *syscall.Rusage) time.Duration {
		return time.Duration(r.Utime.Nano() + r.Stime.Nano())
	}
	return cpu(&after) - cpu(&before), err
}
