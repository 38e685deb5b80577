package main

import (
	"bufio"
	"bytes"
	"cmp"
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"math"
	"math/rand"
	"net/http"
	"net/url"
	"os"
	"os/signal"
	"slices"
	"sort"
	"strings"
	"sync"
	"syscall"
	"time"

	"golang.org/x/term"
)

// benchConfig is a load test against any OpenAI-compatible /v1/completions endpoint.
type benchConfig struct {
	urls                              listFlag
	apiKey, model, dataset, jsonOut   string
	numPrompts, inputLen, outputLen   int
	groups, perGroup, prefixLen, qLen int
	sessions, turns, maxRequests      int
	systemLen                         int
	zipf, rate                        float64
	temperature, topP                 float64
	concurrency, vocabLo, vocabHi     int
	seed                              int64
	timeout                           time.Duration
}

// benchRequest is one planned request: its prompt token ids and output length, and
// (multi-turn) the index of the request whose answer it waits for, or -1.
type benchRequest struct {
	prompt []int
	out    int
	after  int
}

// benchSample is what one request measured.
type benchSample struct {
	OK         bool
	Status     int
	TTFT       time.Duration
	E2E        time.Duration
	ITL        []time.Duration
	OutTokens  int
	Prompt     int
	Cached     int
	Err        string
	RetryAfter bool
	Sent       time.Duration // when it went out, from the start of the run
	// Ended: the request ran to an answer or an error; false for one a signal cut
	// off or kept from being sent.
	Ended bool
}

// BenchResult is the JSON summary of a run.
type BenchResult struct {
	Dataset          string  `json:"dataset"`
	Requests         int     `json:"requests"`
	Completed        int     `json:"completed"`
	Errors           int     `json:"errors"`
	Rejected429      int     `json:"rejected_429"`
	RejectedShare    float64 `json:"rejected_share"`
	Concurrency      int     `json:"concurrency"`
	Rate             float64 `json:"rate"`
	DurationS        float64 `json:"duration_s"`
	RequestsPerS     float64 `json:"requests_per_s"`
	OutputTokensPerS float64 `json:"output_tokens_per_s"`
	TotalTokensPerS  float64 `json:"total_tokens_per_s"`
	CachedShare      float64 `json:"cached_token_share"`
	TTFTms           Pcts    `json:"ttft_ms"`
	TPOTms           Pcts    `json:"tpot_ms"`
	ITLms            Pcts    `json:"itl_ms"`
	E2Ems            Pcts    `json:"e2e_ms"`
	// TTFTLateMS is TTFT over the requests sent in the second half of the run: the
	// steady state, without the cold start (every prefix's first requests).
	TTFTLateMS Pcts `json:"ttft_ms_late"`
	// Interrupted counts the planned requests that a signal (SIGINT, SIGTERM) cut off
	// or kept from being sent; the other numbers are of the rest (Requests), up to the
	// signal.
	Interrupted int `json:"interrupted,omitempty"`
	// CappedArrivals counts Poisson arrivals (--rate) that waited for a slot of
	// --concurrency: the run was partly closed-loop and the offered rate not reached.
	CappedArrivals int `json:"capped_arrivals,omitempty"`
	// FirstError is the first failed request's error (the server's message), so that
	// a run with errors says why.
	FirstError string `json:"first_error,omitempty"`
}

// Pcts are percentiles in milliseconds, of N samples (none: no data, not 0).
type Pcts struct {
	N    int     `json:"n"`
	Mean float64 `json:"mean"`
	P50  float64 `json:"p50"`
	P90  float64 `json:"p90"`
	P99  float64 `json:"p99"`
}

func runBench(args []string, stdout, stderr io.Writer) error {
	fs := newFlags("bench", stdout)
	c := benchConfig{}
	fs.Var(&c.urls, "url", "base URL of the OpenAI-compatible API (default http://127.0.0.1:8080/v1); repeat or comma-separate to spread requests over several nodes in turn")
	fs.StringVar(&c.apiKey, "api-key", os.Getenv("SHOAL_API_KEY"), "bearer key (default $SHOAL_API_KEY)")
	fs.StringVar(&c.model, "model", "", "model id to send (default: the first of /v1/models)")
	fs.StringVar(&c.dataset, "dataset", "random", "random, shared-prefix or multi-turn")
	fs.IntVar(&c.numPrompts, "num-prompts", 64, "requests (random dataset)")
	fs.IntVar(&c.inputLen, "input-len", 128, "prompt tokens (random dataset)")
	fs.IntVar(&c.outputLen, "output-len", 64, "output tokens per request (ignore_eos is set)")
	fs.Float64Var(&c.temperature, "temperature", 0, "sampling temperature of every request (0: greedy)")
	fs.Float64Var(&c.topP, "top-p", 1, "nucleus sampling mass of every request (1: off)")
	fs.IntVar(&c.groups, "groups", 8, "shared-prefix: prefix groups")
	fs.IntVar(&c.perGroup, "prompts-per-group", 8, "shared-prefix: requests per group")
	fs.IntVar(&c.prefixLen, "prefix-len", 512, "shared-prefix: tokens of each group's prefix")
	fs.IntVar(&c.qLen, "question-len", 32, "shared-prefix: tokens after the prefix")
	fs.IntVar(&c.sessions, "sessions", 16, "multi-turn: chat sessions (each starts with its own --prefix-len tokens)")
	fs.IntVar(&c.turns, "turns", 4, "multi-turn: requests per session; each resends the conversation so far plus --question-len new tokens")
	fs.IntVar(&c.systemLen, "system-len", 0, "tokens every prompt starts with (a common system prompt), before the dataset's own")
	fs.IntVar(&c.maxRequests, "max-requests", 0, "send only the first N planned requests (0: all)")
	fs.Float64Var(&c.zipf, "zipf", 0, "shared-prefix: Zipf exponent of group popularity (> 1; 0: uniform, every group equally often)")
	fs.IntVar(&c.concurrency, "concurrency", 8, "requests in flight (closed loop); with --rate, the most in flight (default with --rate: no limit)")
	fs.Float64Var(&c.rate, "rate", 0, "Poisson arrival rate in requests/s (0: closed loop at --concurrency)")
	fs.Int64Var(&c.seed, "seed", 1, "seed of the dataset and arrivals")
	fs.IntVar(&c.vocabLo, "token-min", 100, "smallest random token id")
	fs.IntVar(&c.vocabHi, "token-max", 500, "largest random token id (stay inside the model's vocabulary)")
	fs.StringVar(&c.jsonOut, "json", "", "write the results as JSON to this file ('-': stdout)")
	fs.DurationVar(&c.timeout, "timeout", 10*time.Minute, "per-request timeout")
	ca := fs.String("tls-ca", "", "CA certificate (PEM) to verify nodes serving TLS with (https URLs)")
	if err := parse(fs, args); err != nil {
		return err
	}
	if len(c.urls) == 0 {
		c.urls = listFlag{"http://127.0.0.1:8080/v1"}
	}
	for i, u := range c.urls {
		if err := checkURL(u); err != nil {
			return fmt.Errorf("--url: %w", err)
		}
		if pu, err := url.Parse(u); err == nil && strings.Trim(pu.Path, "/") == "" {
			c.urls[i] = strings.TrimSuffix(u, "/") + "/v1" // a node's address: its OpenAI API
		}
	}
	given := map[string]bool{}
	fs.Visit(func(f *flag.Flag) { given[f.Name] = true })
	switch {
	case c.vocabHi <= c.vocabLo || c.vocabLo < 0:
		return errors.New("--token-max must exceed --token-min >= 0")
	case c.dataset == "shared-prefix" && c.zipf != 0 && c.zipf <= 1:
		return errors.New("--zipf must be greater than 1 (or 0 for uniform)")
	case !(c.rate >= 0) || math.IsInf(c.rate, 0):
		return fmt.Errorf("--rate %v: want requests per second, or 0 for a closed loop", c.rate)
	}
	if err := atLeast(intFlag{"concurrency", c.concurrency, 1}, intFlag{"output-len", c.outputLen, 1}, intFlag{"max-requests", c.maxRequests, 0},
		intFlag{"system-len", c.systemLen, 0}, intFlag{"num-prompts", c.numPrompts, 1}, intFlag{"input-len", c.inputLen, 1},
		intFlag{"groups", c.groups, 1}, intFlag{"prompts-per-group", c.perGroup, 1}, intFlag{"sessions", c.sessions, 1},
		intFlag{"turns", c.turns, 1}, intFlag{"prefix-len", c.prefixLen, 0}, intFlag{"question-len", c.qLen, 0}); err != nil {
		return err
	}
	reqs, err := c.plan()
	if err != nil {
		return err
	}
	if c.rate > 0 && !given["concurrency"] {
		// Open loop: arrivals must not wait for answers (vLLM's default too).
		c.concurrency = max(len(reqs), 1)
	}
	client := &http.Client{Timeout: c.timeout}
	if *ca != "" {
		conf, err := clientTLS(*ca)
		if err != nil {
			return err
		}
		tr := http.DefaultTransport.(*http.Transport).Clone()
		tr.TLSClientConfig = conf
		client.Transport = tr
	}
	if c.model == "" {
		if c.model, err = firstModel(client, c); err != nil {
			return err
		}
	}
	// A signal ends the run early with what it measured: in-flight requests are cut
	// off and nothing more is sent. A second signal kills as usual.
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	context.AfterFunc(ctx, stop)
	res := c.run(ctx, client, reqs, stderr)
	if res.Interrupted > 0 {
		fmt.Fprintf(stderr, "bench: interrupted: %d of %d requests ended before the signal; results are of those\n",
			res.Requests, res.Requests+res.Interrupted)
	}
	if res.CappedArrivals > 0 {
		fmt.Fprintf(stderr, "bench: %d arrivals waited for a free slot of --concurrency %d: the offered rate was not reached\n",
			res.CappedArrivals, c.concurrency)
	}
	table := stdout
	if c.jsonOut == "-" {
		table = stderr // stdout is the JSON alone
	}
	printBench(table, res)
	if c.jsonOut != "" {
		b, _ := json.MarshalIndent(res, "", "  ")
		if c.jsonOut == "-" {
			fmt.Fprintln(stdout, string(b))
		} else if err := os.WriteFile(c.jsonOut, append(b, '\n'), 0o644); err != nil {
			return err
		}
	}
	if res.Completed == 0 && res.Requests > 0 {
		// Nothing measured: a script must not read the run as one.
		return fmt.Errorf("no request of %d completed (%d errors, %d rejected)", res.Requests, res.Errors, res.Rejected429)
	}
	return nil
}

// checkURL reports what is wrong with u as a node's address: it must parse,
// as http or https, with a host.
func checkURL(u string) error {
	p, err := url.Parse(u)
	switch {
	case err != nil:
		return fmt.Errorf("%q is not a URL: %w", u, err)
	case p.Scheme != "http" && p.Scheme != "https":
		return fmt.Errorf("%q: want an http:// or https:// URL", u)
	case p.Host == "":
		return fmt.Errorf("%q has no host", u)
	}
	return nil
}

// plan builds the request list from the dataset flags.
func (c benchConfig) plan() ([]benchRequest, error) {
	r := rand.New(rand.NewSource(c.seed))
	tok := func() int { return c.vocabLo + r.Intn(c.vocabHi-c.vocabLo) }
	var out []benchRequest
	switch c.dataset {
	case "random":
		for range c.numPrompts {
			p := make([]int, c.inputLen)
			for i := range p {
				p[i] = tok()
			}
			out = append(out, benchRequest{prompt: p, out: c.outputLen, after: -1})
		}
	case "shared-prefix":
		prefixes := make([][]int, c.groups)
		for g := range prefixes {
			for range c.prefixLen {
				prefixes[g] = append(prefixes[g], tok())
			}
		}
		n := c.groups * c.perGroup
		var zipf *rand.Zipf
		if c.zipf > 1 {
			zipf = rand.NewZipf(r, c.zipf, 1, uint64(c.groups-1))
		}
		for i := range n {
			g := i % c.groups
			if zipf != nil {
				g = int(zipf.Uint64())
			}
			p := slices.Clone(prefixes[g])
			for range c.qLen {
				p = append(p, tok())
			}
			out = append(out, benchRequest{prompt: p, out: c.outputLen, after: -1})
		}
		if zipf == nil {
			r.Shuffle(len(out), func(i, j int) { out[i], out[j] = out[j], out[i] })
		}
	case "multi-turn":
		out = c.multiTurn(tok, r)
	default:
		return nil, fmt.Errorf("--dataset %q: want random, shared-prefix or multi-turn", c.dataset)
	}
	if c.systemLen > 0 {
		// Drawn after the dataset, which stays the same with or without it.
		system := make([]int, c.systemLen)
		for i := range system {
			system[i] = tok()
		}
		for i := range out {
			out[i].prompt = append(slices.Clone(system), out[i].prompt...)
		}
	}
	if c.maxRequests > 0 && len(out) > c.maxRequests {
		out = out[:c.maxRequests]
	}
	return out, nil
}

// multiTurn plans chat sessions that grow by a turn each request: turn k resends the
// session's first prompt, every earlier question and an answer-sized stand-in for
// every earlier answer (random tokens: a client would send the model's text back,
// which servers do not cache as generated either), then a new question. Turns go
// out round by round, sessions shuffled within a round, and each waits for the
// answer to the session's previous turn, as a person would.
func (c benchConfig) multiTurn(tok func() int, r *rand.Rand) []benchRequest {
	convo := make([][]int, c.sessions)
	for s := range convo {
		for range c.prefixLen {
			convo[s] = append(convo[s], tok())
		}
	}
	last := make([]int, c.sessions)
	var out []benchRequest
	for turn := range c.turns {
		order := r.Perm(c.sessions)
		for _, s := range order {
			if turn > 0 {
				for range c.outputLen {
					convo[s] = append(convo[s], tok())
				}
			}
			for range c.qLen {
				convo[s] = append(convo[s], tok())
			}
			after := -1
			if turn > 0 {
				after = last[s]
			}
			last[s] = len(out)
			out = append(out, benchRequest{prompt: slices.Clone(convo[s]), out: c.outputLen, after: after})
		}
	}
	return out
}

func firstModel(client *http.Client, c benchConfig) (string, error) {
	req, _ := http.NewRequest("GET", strings.TrimSuffix(c.urls[0], "/")+"/models", nil)
	if c.apiKey != "" {
		req.Header.Set("Authorization", "Bearer "+c.apiKey)
	}
	resp, err := client.Do(req)
	if err != nil {
		return "", fmt.Errorf("list models: %w", err)
	}
	defer resp.Body.Close()
	var ml struct {
		Data []struct {
			ID string `json:"id"`
		} `json:"data"`
	}
	if err := json.NewDecoder(resp.Body).Decode(&ml); err != nil || len(ml.Data) == 0 {
		return "", fmt.Errorf("list models: status %d, no model", resp.StatusCode)
	}
	return ml.Data[0].ID, nil
}

// run sends every request, closed-loop or Poisson, and summarises.
func (c benchConfig) run(ctx context.Context, client *http.Client, reqs []benchRequest, stderr io.Writer) BenchResult {
	samples := make([]benchSample, len(reqs))
	var done int
	var mu sync.Mutex
	progress := newProgress(stderr, len(reqs))
	finish := func(i int, s benchSample) {
		s.Ended = s.OK || ctx.Err() == nil
		mu.Lock()
		samples[i] = s
		done++
		progress.update(done)
		mu.Unlock()
	}
	start := time.Now()
	sem := make(chan struct{}, c.concurrency)
	capped := 0
	var wg sync.WaitGroup
	r := rand.New(rand.NewSource(c.seed + 1))
	next := start
	ended := make([]chan struct{}, len(reqs))
	for i := range ended {
		ended[i] = make(chan struct{})
	}
send:
	for i, q := range reqs {
		if c.rate > 0 {
			next = next.Add(time.Duration(r.ExpFloat64() / c.rate * float64(time.Second)))
			select {
			case <-time.After(time.Until(next)):
			case <-ctx.Done():
				break send
			}
		}
		url := c.urls[i%len(c.urls)]
		if q.after >= 0 {
			// A later turn: it goes out once the session's previous answer is in,
			// without holding up the arrivals of other sessions.
			wg.Go(func() {
				defer close(ended[i])
				select {
				case <-ended[q.after]:
				case <-ctx.Done():
					return
				}
				select {
				case sem <- struct{}{}:
				case <-ctx.Done():
					return
				}
				defer func() { <-sem }()
				finish(i, c.one(ctx, client, url, q, start))
			})
			continue
		}
		select {
		case sem <- struct{}{}:
		default:
			capped++ // an arrival waits for an answer: no longer open loop
			select {
			case sem <- struct{}{}:
			case <-ctx.Done():
				break send
			}
		}
		wg.Go(func() {
			defer close(ended[i])
			defer func() { <-sem }()
			finish(i, c.one(ctx, client, url, q, start))
		})
	}
	wg.Wait()
	progress.end()
	res := summarise(c, samples, time.Since(start))
	if c.rate > 0 {
		res.CappedArrivals = capped
	}
	return res
}

// one sends a streamed completion and measures it (Sent counts from the run's start).
func (c benchConfig) one(ctx context.Context, client *http.Client, url string, q benchRequest, start time.Time) benchSample {
	body, _ := json.Marshal(map[string]any{
		"model": c.model, "prompt": q.prompt, "max_tokens": q.out, "temperature": c.temperature, "top_p": c.topP,
		"ignore_eos": true, "stream": true, "stream_options": map[string]bool{"include_usage": true},
	})
	req, _ := http.NewRequestWithContext(ctx, "POST", strings.TrimSuffix(url, "/")+"/completions", bytes.NewReader(body))
	req.Header.Set("Content-Type", "application/json")
	if c.apiKey != "" {
		req.Header.Set("Authorization", "Bearer "+c.apiKey)
	}
	s := benchSample{Prompt: len(q.prompt)}
	t0 := time.Now()
	s.Sent = t0.Sub(start)
	resp, err := client.Do(req)
	if err != nil {
		s.Err = err.Error()
		return s
	}
	defer resp.Body.Close()
	s.Status = resp.StatusCode
	if resp.StatusCode != http.StatusOK {
		b, _ := io.ReadAll(io.LimitReader(resp.Body, 4096))
		s.Err = fmt.Sprintf("status %d: %s", resp.StatusCode, strings.TrimSpace(string(b)))
		return s
	}
	sc := bufio.NewScanner(resp.Body)
	sc.Buffer(make([]byte, 1<<16), 1<<22)
	var last time.Time
	for sc.Scan() {
		line, ok := strings.CutPrefix(sc.Text(), "data: ")
		if !ok {
			continue
		}
		if line == "[DONE]" {
			s.OK = s.Err == ""
			break
		}
		var chunk struct {
			Choices []struct {
				Text string `json:"text"`
			} `json:"choices"`
			Usage *struct {
				PromptTokens     int `json:"prompt_tokens"`
				CompletionTokens int `json:"completion_tokens"`
				Details          struct {
					Cached int `json:"cached_tokens"`
				} `json:"prompt_tokens_details"`
			} `json:"usage"`
			Error *struct {
				Message string `json:"message"`
			} `json:"error"`
		}
		if err := json.Unmarshal([]byte(line), &chunk); err != nil {
			s.Err = "bad chunk: " + err.Error()
			continue
		}
		now := time.Now()
		switch {
		case chunk.Error != nil:
			s.Err = chunk.Error.Message
		case chunk.Usage != nil:
			s.OutTokens, s.Cached, s.Prompt = chunk.Usage.CompletionTokens, chunk.Usage.Details.Cached, chunk.Usage.PromptTokens
		case len(chunk.Choices) > 0 && chunk.Choices[0].Text != "":
			if last.IsZero() {
				s.TTFT = now.Sub(t0)
			} else {
				s.ITL = append(s.ITL, now.Sub(last))
			}
			last = now
		}
	}
	s.E2E = time.Since(t0)
	if err := sc.Err(); err != nil && s.Err == "" {
		s.Err = err.Error()
		s.OK = false
	}
	return s
}

func summarise(c benchConfig, samples []benchSample, d time.Duration) BenchResult {
	res := BenchResult{Dataset: c.dataset, Concurrency: c.concurrency, Rate: c.rate, DurationS: d.Seconds()}
	var ttft, late, tpot, itl, e2e []float64
	var out, prompt, cached int
	var last time.Duration
	for _, s := range samples {
		last = max(last, s.Sent)
	}
	for _, s := range samples {
		if !s.Ended {
			res.Interrupted++
			continue
		}
		res.Requests++
		switch {
		case s.OK:
			res.Completed++
		case s.Status == http.StatusTooManyRequests:
			res.Rejected429++
		default:
			res.Errors++
			if res.FirstError == "" {
				res.FirstError = cmp.Or(s.Err, fmt.Sprintf("status %d", s.Status))
			}
		}
		if !s.OK {
			continue
		}
		out += s.OutTokens
		prompt += s.Prompt
		cached += s.Cached
		ttft = append(ttft, ms(s.TTFT))
		if s.Sent >= last/2 {
			late = append(late, ms(s.TTFT))
		}
		e2e = append(e2e, ms(s.E2E))
		if s.OutTokens > 1 {
			tpot = append(tpot, ms(s.E2E-s.TTFT)/float64(s.OutTokens-1))
		}
		for _, x := range s.ITL {
			itl = append(itl, ms(x))
		}
	}
	secs := d.Seconds()
	if res.Requests > 0 {
		res.RejectedShare = float64(res.Rejected429) / float64(res.Requests)
	}
	res.RequestsPerS = float64(res.Completed) / secs
	res.OutputTokensPerS = float64(out) / secs
	res.TotalTokensPerS = float64(out+prompt) / secs
	if prompt > 0 {
		res.CachedShare = float64(cached) / float64(prompt)
	}
	res.TTFTms, res.TPOTms, res.ITLms, res.E2Ems = pcts(ttft), pcts(tpot), pcts(itl), pcts(e2e)
	res.TTFTLateMS = pcts(late)
	return res
}

func ms(d time.Duration) float64 { return float64(d) / float64(time.Millisecond) }

func pcts(xs []float64) Pcts {
	if len(xs) == 0 {
		return Pcts{}
	}
	sort.Float64s(xs)
	at := func(p float64) float64 { // nearest-rank percentile
		return xs[max(0, min(len(xs)-1, int(math.Ceil(p/100*float64(len(xs))))-1))]
	}
	var sum float64
	for _, x := range xs {
		sum += x
	}
	return Pcts{N: len(xs), Mean: sum / float64(len(xs)), P50: at(50), P90: at(90), P99: at(99)}
}

func printBench(w io.Writer, r BenchResult) {
	fmt.Fprintf(w, "dataset %s: %d requests, %d completed, %d errors, %d rejected (429) in %.1fs\n",
		r.Dataset, r.Requests, r.Completed, r.Errors, r.Rejected429, r.DurationS)
	if r.FirstError != "" {
		fmt.Fprintf(w, "first error: %s\n", r.FirstError)
	}
	fmt.Fprintf(w, "throughput: %.2f req/s, %.1f output tok/s, %.1f total tok/s; cached prompt tokens %.1f%%\n",
		r.RequestsPerS, r.OutputTokensPerS, r.TotalTokensPerS, 100*r.CachedShare)
	fmt.Fprintf(w, "%-15s %10s %10s %10s %10s\n", "ms", "mean", "p50", "p90", "p99")
	for _, row := range []struct {
		n string
		p Pcts
	}{{"TTFT", r.TTFTms}, {"TTFT, 2nd half", r.TTFTLateMS}, {"TPOT", r.TPOTms}, {"ITL", r.ITLms}, {"E2E", r.E2Ems}} {
		if row.p.N == 0 { // nothing measured: not a time of 0
			fmt.Fprintf(w, "%-15s %10s %10s %10s %10s\n", row.n, "-", "-", "-", "-")
			continue
		}
		fmt.Fprintf(w, "%-15s %10.1f %10.1f %10.1f %10.1f\n", row.n, row.p.Mean, row.p.P50, row.p.P90, row.p.P99)
	}
}

// progress draws a bar on a terminal and nothing otherwise.
type progress struct {
	w     io.Writer
	total int
	tty   bool
}

func newProgress(w io.Writer, total int) *progress {
	f, ok := w.(*os.File)
	return &progress{w: w, total: total, tty: ok && term.IsTerminal(int(f.Fd()))}
}

func (p *progress) update(done int) {
	if !p.tty {
		return
	}
	const width = 40
	n := done * width / max(p.total, 1)
	fmt.Fprintf(p.w, "\r[%s%s] %d/%d", strings.Repeat("=", n), strings.Repeat(" ", width-n), done, p.total)
}

func (p *progress) end() {
	if p.tty {
		fmt.Fprintln(p.w)
	}
}
