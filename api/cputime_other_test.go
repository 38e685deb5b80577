//go:build !linux

package api

import "time"

// burn spins for d.
func burn(d time.Duration) {
	for start := time.Now(); time.Since(start) < d; {
	}
}
