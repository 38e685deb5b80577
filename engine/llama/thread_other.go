//go:build !linux

package llama

// threadID is 0 where the thread's id is not read: every call then shares
// one line, as before (llamaErrors).
func threadID() int { return 0 }
