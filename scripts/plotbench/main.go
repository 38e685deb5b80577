// Command plotbench draws the router benchmark's charts and tables: for each
// docs/bench/W.json written by scripts/bench-router, output tokens/s, TTFT p99 and
// cache-hit share against the offered rate, one line per policy, as PNGs in
// docs/img/; and W's table, with the targets checked at saturation, between the
// markers <!-- bench-router:W --> and <!-- /bench-router:W --> in docs/benchmarks.md
// (printed when the markers are missing).
//
//	go run ./scripts/plotbench [docs/bench/W.json ...]
package main

import (
	"cmp"
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strings"

	"gonum.org/v1/plot"
	"gonum.org/v1/plot/plotter"
	"gonum.org/v1/plot/plotutil"
	"gonum.org/v1/plot/vg"
)

type row struct {
	Policy           string  `json:"policy"`
	Rate             float64 `json:"rate"`
	RateShare        float64 `json:"rate_share"` // of round robin's saturation rate; 0 when not measured
	OutputTokensPerS float64 `json:"output_tokens_per_s"`
	TTFTP50          float64 `json:"ttft_p50_ms"`
	TTFTP99          float64 `json:"ttft_p99_ms"`
	TTFTP99Late      float64 `json:"ttft_p99_late_ms"` // requests sent in the cell's second half; 0 in older runs
	E2EP99           float64 `json:"e2e_p99_ms"`
	CacheHitShare    float64 `json:"cache_hit_share"`
	RejectedShare    float64 `json:"rejected_share"`
	LoadSpread       float64 `json:"load_spread"`
	ClosedLoop       bool    `json:"closed_loop"` // every node's batch kept full: the policy's capacity
}

// x is the row's position on the rate axis.
func (r row) x() float64 {
	if r.RateShare > 0 {
		return r.RateShare
	}
	return r.Rate
}

func main() {
	files := os.Args[1:]
	if len(files) == 0 {
		files, _ = filepath.Glob("docs/bench/*.json")
	}
	for _, f := range files {
		if strings.HasPrefix(filepath.Base(f), "profile") {
			continue
		}
		if err := draw(f); err != nil {
			fmt.Fprintln(os.Stderr, "plotbench:", err)
			os.Exit(1)
		}
	}
}

func draw(path string) error {
	b, err := os.ReadFile(path)
	if err != nil {
		return err
	}
	var rows []row
	if err := json.Unmarshal(b, &rows); err != nil {
		return fmt.Errorf("%s: %w", path, err)
	}
	name := strings.TrimSuffix(filepath.Base(path), ".json")
	if err := writeTable(name, rows); err != nil {
		return err
	}
	if err := drawCapacity(name, rows); err != nil {
		return err
	}
	xLabel := "offered rate (requests/s)"
	if len(rows) > 0 && rows[0].RateShare > 0 {
		xLabel = "offered rate (share of round robin's saturation rate)"
	}
	for _, m := range []struct {
		file, y string
		v       func(row) float64
	}{
		{"throughput", "output tokens/s", func(r row) float64 { return r.OutputTokensPerS }},
		{"ttft-p99", "TTFT p99 (ms)", func(r row) float64 { return r.TTFTP99 }},
		{"cache-hits", "cached share of prompt tokens", func(r row) float64 { return r.CacheHitShare }},
	} {
		p := plot.New()
		p.Title.Text = name
		p.X.Label.Text = xLabel
		p.Y.Label.Text = m.y
		var args []any
		var policies []string
		for _, r := range rows {
			if !slices.Contains(policies, r.Policy) {
				policies = append(policies, r.Policy)
			}
		}
		for _, pol := range policies {
			var pts plotter.XYs
			for _, r := range rows {
				if r.Policy == pol && !r.ClosedLoop {
					pts = append(pts, plotter.XY{X: r.x(), Y: m.v(r)})
				}
			}
			slices.SortFunc(pts, func(a, b plotter.XY) int { return cmp.Compare(a.X, b.X) })
			args = append(args, pol, pts)
		}
		if err := plotutil.AddLinePoints(p, args...); err != nil {
			return err
		}
		out := filepath.Join("docs", "img", name+"-"+m.file+".png")
		if err := os.MkdirAll(filepath.Dir(out), 0o755); err != nil {
			return err
		}
		if err := p.Save(6*vg.Inch, 4*vg.Inch, out); err != nil {
			return err
		}
		fmt.Println("wrote", out)
	}
	return nil
}

// writeTable renders name's rows as a Markdown table, with the targets of the router
// benchmark checked at round robin's saturation rate, into docs/benchmarks.md.
func writeTable(name string, rows []row) error {
	var b strings.Builder
	// Runs that measured it show TTFT p99 over the second half of each cell too:
	// the steady state, without the cold start.
	late := slices.ContainsFunc(rows, func(r row) bool { return r.TTFTP99Late > 0 })
	lateHead, lateRule := "", ""
	if late {
		lateHead, lateRule = " TTFT p99, 2nd half ms |", "---|"
	}
	fmt.Fprintf(&b, "| policy | rate (× sat) | req/s | output tok/s | TTFT p50 ms | TTFT p99 ms |%s E2E p99 ms | cache-hit share | 429 share | load spread |\n", lateHead)
	fmt.Fprintf(&b, "|---|---|---|---|---|---|%s---|---|---|---|\n", lateRule)
	sorted := slices.Clone(rows)
	slices.SortStableFunc(sorted, func(a, b row) int {
		if a.ClosedLoop != b.ClosedLoop { // capacities last
			return map[bool]int{true: 1, false: -1}[a.ClosedLoop]
		}
		if a.ClosedLoop {
			return 0
		}
		return cmp.Compare(a.x(), b.x())
	})
	for _, r := range sorted {
		share := "-"
		switch {
		case r.ClosedLoop:
			share = fmt.Sprintf("capacity (%.2f)", r.RateShare)
		case r.RateShare > 0:
			share = fmt.Sprintf("%.1f", r.RateShare)
		}
		pol := r.Policy
		if pol == "prefix-aware" {
			pol = "**prefix-aware**"
		}
		lateCell := ""
		if late {
			lateCell = fmt.Sprintf(" %.0f |", r.TTFTP99Late)
		}
		fmt.Fprintf(&b, "| %s | %s | %.2f | %.1f | %.0f | %.0f |%s %.0f | %.2f | %.2f | %.2f |\n",
			pol, share, r.Rate, r.OutputTokensPerS, r.TTFTP50, r.TTFTP99, lateCell, r.E2EP99, r.CacheHitShare, r.RejectedShare, r.LoadSpread)
	}
	b.WriteString(verdict(name, rows))
	const doc = "docs/benchmarks.md"
	begin, end := "<!-- bench-router:"+name+" -->", "<!-- /bench-router:"+name+" -->"
	text, err := os.ReadFile(doc)
	if err != nil {
		return err
	}
	i, j := strings.Index(string(text), begin), strings.Index(string(text), end)
	if i < 0 || j < i {
		fmt.Printf("%s (no %s markers in %s):\n%s\n", name, begin, doc, b.String())
		return nil
	}
	out := string(text[:i+len(begin)]) + "\n" + b.String() + string(text[j:])
	fmt.Println("wrote table", name, "into", doc)
	return os.WriteFile(doc, []byte(out), 0o644)
}

// verdict checks the targets at saturation, each policy's capacity (closed
// loop, every batch full): on the shared-prefix and multi-turn workloads prefix-aware
// against round robin; on the controls prefix-aware against the best other policy.
func verdict(name string, rows []row) string {
	at := map[string]row{}
	for _, r := range rows {
		if r.ClosedLoop {
			at[r.Policy] = r
		}
	}
	pa, ok := at["prefix-aware"]
	if !ok {
		return ""
	}
	if rr, ok := at["round-robin"]; ok && (strings.HasPrefix(name, "shared-prefix") || name == "multi-turn") {
		if rr.OutputTokensPerS == 0 || rr.CacheHitShare == 0 || rr.TTFTP99 == 0 {
			return ""
		}
		return fmt.Sprintf("\nAt saturation (capacity rows), prefix-aware / round robin: output throughput %.2f×, cache-hit share %.2f×, TTFT p99 %.2f×.\n",
			pa.OutputTokensPerS/rr.OutputTokensPerS, pa.CacheHitShare/rr.CacheHitShare, pa.TTFTP99/rr.TTFTP99)
	}
	best, bestName := 0.0, ""
	for p, r := range at {
		if p != "prefix-aware" && r.OutputTokensPerS > best {
			best, bestName = r.OutputTokensPerS, p
		}
	}
	if best == 0 {
		return ""
	}
	return fmt.Sprintf("\nAt saturation (capacity rows), prefix-aware's output throughput is %.3f× the best other policy's (%s).\n", pa.OutputTokensPerS/best, bestName)
}

// drawCapacity is W-capacity.png: each policy's output tokens/s in the closed loop
// (its capacity), as bars; nothing when the file has no capacity rows.
func drawCapacity(name string, rows []row) error {
	var vals plotter.Values
	var names []string
	for _, r := range rows {
		if r.ClosedLoop {
			vals = append(vals, r.OutputTokensPerS)
			names = append(names, r.Policy)
		}
	}
	if len(vals) == 0 {
		return nil
	}
	p := plot.New()
	p.Title.Text = name + ": capacity (closed loop, every batch full)"
	p.Y.Label.Text = "output tokens/s"
	bars, err := plotter.NewBarChart(vals, vg.Points(40))
	if err != nil {
		return err
	}
	bars.Color = plotutil.Color(1)
	p.Add(bars)
	p.NominalX(names...)
	out := filepath.Join("docs", "img", name+"-capacity.png")
	if err := p.Save(6*vg.Inch, 4*vg.Inch, out); err != nil {
		return err
	}
	fmt.Println("wrote", out)
	return nil
}
