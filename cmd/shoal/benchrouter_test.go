package main

import (
	"context"
	"encoding/json"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"syscall"
	"testing"
	"time"
)

// TestBenchRouterSmoke runs scripts/bench-router at its smallest (2 simulated nodes,
// one workload, two policies, one rate, 20× speed) into a temporary directory, so
// that the script behind the router tables of docs/benchmarks.md keeps working.
func TestBenchRouterSmoke(t *testing.T) {
	if testing.Short() {
		t.Skip("skipping the bench-router smoke run in -short mode")
	}
	for _, tool := range []string{"curl", "python3", "make"} {
		if _, err := exec.LookPath(tool); err != nil {
			t.Fatalf("%s missing (scripts/test-deps.sh installs curl and python3): %v", tool, err)
		}
	}
	base := freePorts(t, 1, 2, 101, 102)
	dir := t.TempDir()
	ctx, cancel := context.WithTimeout(context.Background(), 4*time.Minute)
	defer cancel()
	cmd := exec.CommandContext(ctx, "bash", "../../scripts/bench-router", "-n", "2", "-w", "shared-prefix",
		"-P", "round-robin,prefix-aware", "-r", "0.5x", "-s", "20", "-d", "1")
	cmd.Env = append(os.Environ(), "BENCH_OUT="+dir, "PORT_BASE="+strconv.Itoa(base), "NO_PLOT=1",
		"SP_GROUPS=2", "SP_PER_GROUP=4", "PREFIX_LEN=256", "CTX=2048")
	// Its own process group, so that a timeout takes the nodes down with it.
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	cmd.Cancel = func() error { return syscall.Kill(-cmd.Process.Pid, syscall.SIGKILL) }
	out, err := cmd.CombinedOutput()
	if err != nil {
		t.Fatalf("bench-router: %v\n%s", err, out)
	}
	b, err := os.ReadFile(filepath.Join(dir, "shared-prefix.json"))
	if err != nil {
		t.Fatalf("%v\n%s", err, out)
	}
	var rows []struct {
		Policy         string  `json:"policy"`
		Requests       int     `json:"requests"`
		OutputTokensPS float64 `json:"output_tokens_per_s"`
		CacheHitShare  float64 `json:"cache_hit_share"`
		ClosedLoop     bool    `json:"closed_loop"`
		RateShare      float64 `json:"rate_share"`
		SaturationRate float64 `json:"saturation_rate"`
		TTFTP99        float64 `json:"ttft_p99_ms"`
	}
	if err := json.Unmarshal(b, &rows); err != nil {
		t.Fatal(err)
	}
	if len(rows) != 4 { // per policy: its capacity (closed loop) and the one rate
		t.Fatalf("%d rows, want 4:\n%s", len(rows), b)
	}
	for _, r := range rows {
		if r.Requests == 0 || r.OutputTokensPS <= 0 || r.TTFTP99 <= 0 || r.SaturationRate <= 0 {
			t.Errorf("row without measurements: %+v", r)
		}
		if !r.ClosedLoop && r.RateShare != 0.5 {
			t.Errorf("open-loop row at %v of saturation, want 0.5", r.RateShare)
		}
		if r.Policy == "prefix-aware" && r.CacheHitShare == 0 {
			t.Errorf("prefix-aware routing of a shared-prefix workload hit no cache: %+v", r)
		}
	}
	t.Logf("bench-router smoke run:\n%s", b)
}

// freePorts returns a base port such that base+off is free for every offset.
func freePorts(t *testing.T, offs ...int) int {
	t.Helper()
	for range 50 {
		l, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			t.Fatal(err)
		}
		base := l.Addr().(*net.TCPAddr).Port - offs[0]
		l.Close()
		if base < 1024 || base+offs[len(offs)-1] > 65535 {
			continue
		}
		ok := true
		for _, o := range offs {
			ln, err := net.Listen("tcp", fmt.Sprintf("127.0.0.1:%d", base+o))
			if err != nil {
				ok = false
				break
			}
			ln.Close()
		}
		if ok {
			return base
		}
	}
	t.Fatal("no free ports for the nodes")
	return 0
}
