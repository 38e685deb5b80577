package cluster

import (
	"fmt"
	"strings"
	"testing"
	"time"

	metrics "github.com/hashicorp/go-metrics"

	"github.com/shoal-ai/shoal/kvcache"
)

// BenchmarkGossip starts n in-process nodes on 127.0.0.1 (default intervals: load
// every 250 ms, push/pull every 5 s), each with a 1,000-block cache summary, and
// reports how long until every node knows every other node's load and summary, and
// the bytes each node sends per second in steady state (memberlist's own UDP and TCP
// counters: probes, gossip, broadcasts, push/pull).
func BenchmarkGossip(b *testing.B) {
	for _, n := range []int{8, 32, 64} {
		b.Run(fmt.Sprintf("nodes=%d", n), func(b *testing.B) {
			for b.Loop() {
				conv, bps := gossipRun(b, n, 10*time.Second)
				b.ReportMetric(conv.Seconds(), "converge_s")
				b.ReportMetric(bps, "bytes/s/node")
			}
		})
	}
}

func gossipRun(b *testing.B, n int, window time.Duration) (time.Duration, float64) {
	sink := metrics.NewInmemSink(time.Hour, time.Hour)
	cfgM := metrics.DefaultConfig("g")
	cfgM.EnableHostname, cfgM.EnableRuntimeMetrics, cfgM.EnableServiceLabel = false, false, false
	if _, err := metrics.NewGlobal(cfgM, sink); err != nil {
		b.Fatal(err)
	}
	var nodes []*Node
	defer func() {
		for _, nd := range nodes {
			nd.Leave(200 * time.Millisecond)
		}
	}()
	start := time.Now()
	for i := range n {
		l := &fakeLocal{}
		hs := make([]kvcache.Hash, 1000)
		for j := range hs {
			hs[j] = kvcache.Hash(uint64(i)<<32 | uint64(j))
		}
		l.set(Load{Waiting: i, PrefillTPS: 100}, hs, 1)
		cfg := DefaultConfig()
		cfg.Name, cfg.Bind, cfg.Secret = fmt.Sprintf("n%02d", i), "127.0.0.1:0", []byte("s")
		cfg.Meta = Meta{HTTP: "127.0.0.1:1", Models: []string{"m"}, Capacity: 8}
		cfg.metricLabels = map[string]string{"node": cfg.Name}
		if i > 0 {
			cfg.Join = []string{nodes[0].GossipAddr()}
		}
		nd, err := New(cfg, l, quiet())
		if err != nil {
			b.Fatal(err)
		}
		if err := nd.Start(); err != nil {
			b.Fatal(err)
		}
		nodes = append(nodes, nd)
	}
	deadline := time.Now().Add(2 * time.Minute)
	for !converged(nodes) {
		if time.Now().After(deadline) {
			b.Fatalf("%d nodes did not converge", n)
		}
		time.Sleep(50 * time.Millisecond)
	}
	conv := time.Since(start)
	before := sentBytes(sink)
	time.Sleep(window)
	return conv, (sentBytes(sink) - before) / window.Seconds() / float64(n)
}

func converged(nodes []*Node) bool {
	for _, nd := range nodes {
		ms := nd.Members()
		if len(ms) != len(nodes) {
			return false
		}
		for _, m := range ms {
			if m.State != "alive" || m.Load.Seq == 0 || m.SummaryBlocks != 1000 {
				return false
			}
		}
	}
	return true
}

func sentBytes(s *metrics.InmemSink) float64 {
	var total float64
	for _, iv := range s.Data() {
		iv.RLock()
		for k, c := range iv.Counters {
			if strings.Contains(k, "memberlist.udp.sent") || strings.Contains(k, "memberlist.tcp.sent") {
				total += c.Sum
			}
		}
		iv.RUnlock()
	}
	return total
}
