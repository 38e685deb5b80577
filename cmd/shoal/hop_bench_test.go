package main

import (
	"fmt"
	"io"
	"net/http"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"
)

// BenchmarkForwardHop measures what one forwarding hop costs, with simulated nodes
// whose decode takes no time: node a does not serve model m, so every request for m
// sent to a is forwarded to b. Reported side by side: latency p50/p99 of sequential
// one-token completions direct to b and through a, and completions/s at 32 in flight
// through a (the most forwarded requests/s a node sustains here) and direct.
func BenchmarkForwardHop(b *testing.B) {
	dir := b.TempDir()
	prof := filepath.Join(dir, "zero.json")
	if err := os.WriteFile(prof, []byte(`{"model":"m","base_us":0,"per_token_us":0,"per_attend_us":0}`), 0o644); err != nil {
		b.Fatal(err)
	}
	key := "MDEyMzQ1Njc4OWFiY2RlZjAxMjM0NTY3ODlhYmNkZWY="
	g := freeAddrTB(b)
	nb := startNode(b, "--sim", prof, "--model-name", "m", "--gossip-addr", g, "--gossip-key", key)
	na := startNode(b, "--sim", prof, "--model-name", "other", "--gossip-addr", freeAddrTB(b), "--gossip-key", key, "--join", g)
	body := `{"model":"m","prompt":"hi","max_tokens":1}`
	deadline := time.Now().Add(20 * time.Second)
	for {
		resp, err := http.Post(na.url+"/v1/completions", "application/json", strings.NewReader(body))
		if err == nil {
			io.Copy(io.Discard, resp.Body)
			resp.Body.Close()
			if resp.StatusCode == 200 {
				break
			}
		}
		if time.Now().After(deadline) {
			b.Fatal("a never forwarded to b")
		}
		time.Sleep(50 * time.Millisecond)
	}
	client := &http.Client{Transport: &http.Transport{MaxIdleConnsPerHost: 64}}
	one := func(url string) (time.Duration, error) {
		start := time.Now()
		resp, err := client.Post(url+"/v1/completions", "application/json", strings.NewReader(body))
		if err != nil {
			return 0, err
		}
		io.Copy(io.Discard, resp.Body)
		resp.Body.Close()
		if resp.StatusCode != 200 {
			return 0, fmt.Errorf("status %d", resp.StatusCode)
		}
		return time.Since(start), nil
	}
	for _, c := range []struct{ name, url string }{{"direct", nb.url}, {"forwarded", na.url}} {
		b.Run("latency/"+c.name, func(b *testing.B) {
			var ds []float64
			for b.Loop() {
				for range 300 {
					d, err := one(c.url)
					if err != nil {
						b.Fatal(err)
					}
					ds = append(ds, float64(d)/float64(time.Millisecond))
				}
			}
			slices.Sort(ds)
			b.ReportMetric(ds[len(ds)/2], "p50_ms")
			b.ReportMetric(ds[len(ds)*99/100], "p99_ms")
		})
		b.Run("throughput/"+c.name, func(b *testing.B) {
			var total atomic.Int64
			var elapsed time.Duration
			for b.Loop() {
				stop := time.Now().Add(3 * time.Second)
				start := time.Now()
				var wg sync.WaitGroup
				for range 32 {
					wg.Go(func() {
						for time.Now().Before(stop) {
							if _, err := one(c.url); err == nil {
								total.Add(1)
							}
						}
					})
				}
				wg.Wait()
				elapsed += time.Since(start)
			}
			b.ReportMetric(float64(total.Load())/elapsed.Seconds(), "req/s")
		})
	}
}

func freeAddrTB(t testing.TB) string {
	t.Helper()
	l, err := netListen()
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	return l.Addr().String()
}
