package api

import "time"

// burn spins until the calling thread has spent d of CPU time (onThreadCPU
// runs its function on one locked thread), or d has passed where a thread's
// CPU time cannot be read.
func burn(d time.Duration) {
	if start, ok := threadCPU(); ok {
		for now, _ := threadCPU(); now-start < d; now, _ = threadCPU() {
		}
		return
	}
	for start := time.Now(); time.Since(start) < d; {
	}
}
