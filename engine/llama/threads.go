package llama

import (
	"fmt"
	"io/fs"
	"os"
	"runtime"
	"strconv"
	"strings"
)

// DefaultThreads is the number of threads llama.cpp computes with when none is
// given: one per physical core among the CPUs this process may run on, as
// llama.cpp's own default counts them (two hyperthreads of a core share its
// arithmetic units, and llama.cpp's threads wait for each other by spinning,
// so a thread more than the cores slows every step), and at most GOMAXPROCS,
// which Go sets from a container's CPU limit. Where the topology cannot be
// read, every CPU the process may use.
func DefaultThreads() int {
	status, _ := os.ReadFile("/proc/self/status")
	return defaultThreads(os.DirFS("/sys/devices/system/cpu"), allowedCPUs(string(status)), runtime.GOMAXPROCS(0))
}

// defaultThreads counts the cores of cpus in sys (a /sys/devices/system/cpu),
// at most procs. A CPU without a topology (offline, though allowed) counts
// for none; none with one, every CPU counts.
func defaultThreads(sys fs.FS, cpus []int, procs int) int {
	cores := map[string]bool{}
	for _, c := range cpus {
		b, err := fs.ReadFile(sys, fmt.Sprintf("cpu%d/topology/core_cpus_list", c))
		if err != nil {
			b, err = fs.ReadFile(sys, fmt.Sprintf("cpu%d/topology/thread_siblings_list", c)) // before Linux 5.7
		}
		if err == nil {
			cores[strings.TrimSpace(string(b))] = true
		}
	}
	n := len(cores)
	if n == 0 {
		n = len(cpus)
	}
	return max(1, min(n, procs))
}

// allowedCPUs reads the CPUs a process may run on from its /proc/PID/status
// ("Cpus_allowed_list: 0-3,8"); without it, 0 to runtime.NumCPU()-1.
func allowedCPUs(status string) []int {
	for line := range strings.Lines(status) {
		list, ok := strings.CutPrefix(line, "Cpus_allowed_list:")
		if !ok {
			continue
		}
		if cpus, ok := parseCPUList(strings.TrimSpace(list)); ok {
			return cpus
		}
		break
	}
	cpus := make([]int, runtime.NumCPU())
	for i := range cpus {
		cpus[i] = i
	}
	return cpus
}

// parseCPUList reads a kernel CPU list: "0-3,8,10-11".
func parseCPUList(s string) ([]int, bool) {
	var cpus []int
	for part := range strings.SplitSeq(s, ",") {
		lo, hi, isRange := strings.Cut(part, "-")
		a, err1 := strconv.Atoi(lo)
		b, err2 := a, error(nil)
		if isRange {
			b, err2 = strconv.Atoi(hi)
		}
		if err1 != nil || err2 != nil || a < 0 || b < a || b-a > 1<<16 || len(cpus) > 1<<16 {
			return nil, false
		}
		for c := a; c <= b; c++ {
			cpus = append(cpus, c)
		}
	}
	return cpus, len(cpus) > 0
}
