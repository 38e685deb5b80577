// Command plotbench draws the router benchmark's charts: for each docs/bench/W.json
// written by scripts/bench-router, output tokens/s and TTFT p99 against the offered
// rate, one line per policy, as PNGs in docs/img/.
//
//	go run ./scripts/plotbench [docs/bench/W.json ...]
package main

import (
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
	OutputTokensPerS float64 `json:"output_tokens_per_s"`
	TTFTP99          float64 `json:"ttft_p99_ms"`
	CacheHitShare    float64 `json:"cache_hit_share"`
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
		p.X.Label.Text = "offered rate (requests/s)"
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
				if r.Policy == pol {
					pts = append(pts, plotter.XY{X: r.Rate, Y: m.v(r)})
				}
			}
			slices.SortFunc(pts, func(a, b plotter.XY) int { return int(a.X - b.X) })
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
