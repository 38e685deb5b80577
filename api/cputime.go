package api

import (
	"runtime"
	"time"
)

// onThreadCPU runs fn on one OS thread and returns the CPU time that thread
// spent on it: what fn costs, whatever else the machine is doing (its wall
// time where the thread's usage cannot be read).
func onThreadCPU(fn func() error) (time.Duration, error) {
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	start := time.Now()
	before, ok1 := threadCPU()
	err := fn()
	wall := time.Since(start)
	after, ok2 := threadCPU()
	if !ok1 || !ok2 {
		return wall, err
	}
	return after - before, err
}
