//go:build !linux

package api

import "time"

// onThreadCPU runs fn and returns the time it took (its CPU time where the
// system tells it per thread: Linux).
func onThreadCPU(fn func() error) (time.Duration, error) {
	start := time.Now()
	err := fn()
	return time.Since(start), err
}
