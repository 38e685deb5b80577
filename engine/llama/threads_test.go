package llama

import (
	"slices"
	"testing"
	"testing/fstest"
)

// TestDefaultThreads: one thread per physical core of the CPUs allowed, at
// most GOMAXPROCS; every CPU where the topology cannot be read.
func TestDefaultThreads(t *testing.T) {
	// Four cores with two hyperthreads each: CPUs 0-3 and their siblings 4-7.
	sys := fstest.MapFS{}
	for c := range 8 {
		sys[cpuFile(c, "core_cpus_list")] = &fstest.MapFile{Data: []byte(cpuName(c%4) + "," + cpuName(c%4+4) + "\n")}
	}
	for _, c := range []struct {
		cpus  []int
		procs int
		want  int
	}{
		{[]int{0, 1, 2, 3, 4, 5, 6, 7}, 8, 4},
		{[]int{0, 4}, 8, 1},                   // one core's two hyperthreads
		{[]int{0, 1, 2, 3, 4, 5, 6, 7}, 2, 2}, // a container's limit of 2 CPUs
		{[]int{0, 9}, 8, 1},                   // cpu9 is offline (no topology): cpu0's core alone
		{[]int{9, 10}, 8, 2},                  // no topology at all: every CPU
	} {
		if got := defaultThreads(sys, c.cpus, c.procs); got != c.want {
			t.Errorf("cpus %v, GOMAXPROCS %d: %d threads, want %d", c.cpus, c.procs, got, c.want)
		}
	}
	old := fstest.MapFS{cpuFile(0, "thread_siblings_list"): {Data: []byte("0-1")}, cpuFile(1, "thread_siblings_list"): {Data: []byte("0-1")}}
	if got := defaultThreads(old, []int{0, 1}, 4); got != 1 {
		t.Errorf("a kernel before 5.7: %d threads, want 1", got)
	}
	if got := DefaultThreads(); got < 1 {
		t.Errorf("this machine: %d threads", got)
	}
}

func TestAllowedCPUs(t *testing.T) {
	if got := allowedCPUs("Name:\tshoal\nCpus_allowed:\tff\nCpus_allowed_list:\t0-2,5,7-8\n"); !slices.Equal(got, []int{0, 1, 2, 5, 7, 8}) {
		t.Errorf("got %v", got)
	}
	for _, bad := range []string{"", "Cpus_allowed_list:\t3-1\n", "Cpus_allowed_list:\tx\n", "Cpus_allowed_list:\t0-99999999\n"} {
		if got := allowedCPUs(bad); len(got) == 0 || got[0] != 0 {
			t.Errorf("%q: %v, want 0 to NumCPU-1", bad, got)
		}
	}
}

func cpuFile(c int, name string) string { return "cpu" + cpuName(c) + "/topology/" + name }
func cpuName(c int) string              { return string(rune('0' + c)) }
