package api

import (
	"errors"
	"fmt"
	"strconv"
	"strings"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/shoal-ai/shoal/scheduler"
)

// metrics exports vLLM-compatible metric names where the meaning matches, so that
// dashboards and routers built for vLLM read a shoal node, and shoal_* for the rest.
// Gauges and counters of the scheduler are read from its Load snapshot at scrape
// time; latencies are observed by the handlers.
type metrics struct {
	ttft, itl, e2e, queue prometheus.Observer
	success               *prometheus.CounterVec
	rejects               *prometheus.CounterVec
	// images counts the images of prompts laid out for computing here;
	// encode, per such prompt, the projector's time for them.
	images prometheus.Counter
	encode prometheus.Observer
}

// Latency buckets (seconds), the ones vLLM uses for these histograms.
var (
	ttftBuckets = []float64{0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1, 2.5, 5, 7.5, 10, 20, 40, 80, 160, 640, 2560}
	itlBuckets  = []float64{0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1, 2.5, 5, 7.5, 10, 20, 40, 80}
	e2eBuckets  = []float64{0.3, 0.5, 0.8, 1, 1.5, 2, 2.5, 5, 10, 15, 20, 30, 40, 50, 60, 120, 240, 480, 960, 1920, 7680}
)

func newMetrics(reg prometheus.Registerer, s *Server) (*metrics, error) {
	labels := prometheus.Labels{"model_name": s.cfg.ModelName}
	load := func(f func(scheduler.Load) float64) func() float64 {
		return func() float64 {
			if b := s.backend.Load(); b != nil {
				return f(b.Generator.Load())
			}
			return 0
		}
	}
	hist := func(name, help string, buckets []float64) prometheus.Histogram {
		return prometheus.NewHistogram(prometheus.HistogramOpts{Name: name, Help: help, Buckets: buckets, ConstLabels: labels})
	}
	ttft := hist("vllm:time_to_first_token_seconds", "Time to first token in seconds.", ttftBuckets)
	itl := hist("vllm:inter_token_latency_seconds", "Time between consecutive output tokens in seconds.", itlBuckets)
	e2e := hist("vllm:e2e_request_latency_seconds", "End-to-end request latency in seconds.", e2eBuckets)
	queue := hist("vllm:request_queue_time_seconds", "Time requests spent waiting before first scheduled, in seconds.", e2eBuckets)
	encode := hist("shoal_image_encode_seconds", "Time the projector took to lay out and encode a prompt's images (waiting for it included), in seconds.", ttftBuckets)
	images := prometheus.NewCounter(prometheus.CounterOpts{Name: "shoal_images_total", Help: "Images of prompts computed here (--mmproj).", ConstLabels: labels})
	m := &metrics{
		ttft: ttft, itl: itl, e2e: e2e, queue: queue, images: images, encode: encode,
		success: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "vllm:request_success_total",
			Help: "Finished choices by finish reason.", ConstLabels: labels}, []string{"finished_reason"}),
		rejects: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "shoal_requests_rejected_total",
			Help: "Requests refused before scheduling, by reason.", ConstLabels: labels}, []string{"reason"}),
	}
	// Every series from the start, at 0, so that a rate over them works before
	// the first of each (and a dashboard shows 0, not "no data").
	for _, r := range []string{string(scheduler.FinishStop), string(scheduler.FinishLength), abortLabel} {
		m.success.WithLabelValues(r)
	}
	for _, r := range rejectReasons {
		m.rejects.WithLabelValues(r)
	}
	gauge := func(name, help string, f func(scheduler.Load) float64) prometheus.Collector {
		return prometheus.NewGaugeFunc(prometheus.GaugeOpts{Name: name, Help: help, ConstLabels: labels}, load(f))
	}
	counter := func(name, help string, f func(scheduler.Load) float64) prometheus.Collector {
		return prometheus.NewCounterFunc(prometheus.CounterOpts{Name: name, Help: help, ConstLabels: labels}, load(f))
	}
	cs := []prometheus.Collector{
		ttft, itl, e2e, queue, m.success, m.rejects, images, encode,
		gauge("vllm:num_requests_running", "Sequences running on the engine.", func(l scheduler.Load) float64 { return float64(l.Running) }),
		gauge("vllm:num_requests_waiting", "Sequences waiting to be scheduled.", func(l scheduler.Load) float64 { return float64(l.Waiting) }),
		gauge("vllm:kv_cache_usage_perc", "Fraction of KV blocks in use by running sequences (1 = full).", func(l scheduler.Load) float64 {
			if l.KVBlocksTotal == 0 {
				return 0
			}
			return float64(l.KVBlocksUsed) / float64(l.KVBlocksTotal)
		}),
		counter("vllm:prefix_cache_queries_total", "Prompt tokens looked up in the prefix cache.", func(l scheduler.Load) float64 { return float64(l.PrefixQueries) }),
		counter("vllm:prefix_cache_hits_total", "Prompt tokens found in the prefix cache.", func(l scheduler.Load) float64 { return float64(l.PrefixHits) }),
		counter("vllm:prompt_tokens_total", "Prompt tokens of requests whose prompt was computed (prefix-cache hits included, as vLLM).", func(l scheduler.Load) float64 { return float64(l.PromptTokens) }),
		counter("shoal_prompt_tokens_computed_total", "Prompt tokens computed (prefix-cache hits excluded; preempted sequences' recomputes included).", func(l scheduler.Load) float64 { return float64(l.ComputedTokens) }),
		counter("vllm:generation_tokens_total", "Tokens generated.", func(l scheduler.Load) float64 { return float64(l.GeneratedTokens) }),
		counter("vllm:spec_decode_num_draft_tokens_total", "Tokens proposed by speculative decoding (n-gram lookup, --spec-tokens).", func(l scheduler.Load) float64 { return float64(l.SpecProposed) }),
		counter("vllm:spec_decode_num_accepted_tokens_total", "Proposed tokens the model drew the same (each saved a step).", func(l scheduler.Load) float64 { return float64(l.SpecAccepted) }),
		counter("shoal_preemptions_total", "Sequences preempted for KV space (resumed by recompute).", func(l scheduler.Load) float64 { return float64(l.Preemptions) }),
		counter("shoal_scheduler_steps_total", "Forward passes run by the scheduler.", func(l scheduler.Load) float64 { return float64(l.Steps) }),
		gauge("shoal_kv_blocks_cached", "Unreferenced KV blocks kept for prefix reuse.", func(l scheduler.Load) float64 { return float64(l.KVBlocksCached) }),
		gauge("shoal_kv_cache_budget_blocks", "Most unreferenced KV blocks kept for prefix reuse now (one pool: between --prefix-cache-floor and the pool, as reuse shows it pays).", func(l scheduler.Load) float64 { return float64(l.KVCacheBudget) }),
		gauge("shoal_kv_blocks_capacity", "KV blocks in the pool.", func(l scheduler.Load) float64 { return float64(l.KVBlocksTotal) }),
		gauge("shoal_prefill_tokens_per_second", "Smoothed prefill speed: prompt tokens per second in steps that are mostly prefill.", func(l scheduler.Load) float64 { return l.PrefillTokensPS }),
		gauge("shoal_decode_tokens_per_second", "Smoothed tokens generated per second.", func(l scheduler.Load) float64 { return l.DecodeTokensPS }),
		gauge("shoal_queue_wait_estimate_seconds", "Estimated wait before a new request is scheduled.", func(l scheduler.Load) float64 { return l.QueueWait.Seconds() }),
		infoCollector{s: s, cacheInfo: prometheus.NewDesc("vllm:cache_config_info", "Information of the KV cache configuration (value 1).",
			[]string{"num_gpu_blocks", "kv_unified"}, prometheus.Labels(s.cfg.CacheInfo))},
	}
	for _, c := range cs {
		if err := reg.Register(c); err != nil {
			return nil, fmt.Errorf("api: register metrics: %w", err)
		}
	}
	return m, nil
}

func (m *metrics) finished(f scheduler.FinishReason) {
	if f == scheduler.FinishCancelled {
		f = abortLabel
	}
	m.success.WithLabelValues(string(f)).Inc()
}

// abortLabel is vLLM's finished_reason for a cancelled request.
const abortLabel = "abort"

// aborted counts n choices whose client left before they ended.
func (m *metrics) aborted(n int) {
	if n > 0 {
		m.success.WithLabelValues(abortLabel).Add(float64(n))
	}
}

// rejectReasons are the reason labels of shoal_requests_rejected_total.
var rejectReasons = []string{"invalid", "queue_full", "too_long", "draining", "cluster_saturated"}

func (m *metrics) rejected(err error) {
	reason := "invalid"
	switch {
	case errors.Is(err, scheduler.ErrQueueFull):
		reason = "queue_full"
	case errors.Is(err, scheduler.ErrPromptTooLong):
		reason = "too_long"
	case errors.Is(err, scheduler.ErrClosed):
		reason = "draining"
	case errors.Is(err, errSaturatedMarker):
		reason = "cluster_saturated"
	}
	m.rejects.WithLabelValues(reason).Inc()
}

// infoCollector reports what is known once the model is loaded: the KV cache
// configuration with its real block count, the devices and the layers offloaded.
// Before that it reports nothing (an unchecked collector).
type infoCollector struct {
	s         *Server
	cacheInfo *prometheus.Desc // its constant labels are the configuration's, fixed at start; the pool's size and layout come with the engine
}

var (
	deviceInfoDesc = prometheus.NewDesc("shoal_device_info", "Compute devices the engine found (value 1).",
		[]string{"device", "description", "kind"}, nil)
	deviceMemDesc = prometheus.NewDesc("shoal_device_memory_bytes", "Device memory when the model was loaded: total and free.",
		[]string{"device", "state"}, nil)
	gpuLayersDesc = prometheus.NewDesc("shoal_gpu_layers", "Model layers offloaded to GPUs.", []string{"model_name"}, nil)
	// loraInfoDesc is vLLM's: the adapters with requests running and waiting,
	// comma-separated, and how many adapters a step runs (one, here); its value
	// is the time it was read, as vLLM's.
	loraInfoDesc = prometheus.NewDesc("vllm:lora_requests_info", "Running stats on LoRA requests.",
		[]string{"running_lora_adapters", "waiting_lora_adapters", "max_lora"}, nil)
)

func (infoCollector) Describe(chan<- *prometheus.Desc) {}

func (c infoCollector) Collect(ch chan<- prometheus.Metric) {
	b := c.s.backend.Load()
	if b == nil {
		return
	}
	l := b.Generator.Load()
	ch <- prometheus.MustNewConstMetric(c.cacheInfo, prometheus.GaugeValue, 1, strconv.Itoa(l.KVBlocksTotal), strconv.FormatBool(b.Capacity.Unified))
	for _, d := range b.Info.Devices {
		ch <- prometheus.MustNewConstMetric(deviceInfoDesc, prometheus.GaugeValue, 1, d.Name, d.Description, d.Kind)
		ch <- prometheus.MustNewConstMetric(deviceMemDesc, prometheus.GaugeValue, float64(d.MemoryTotal), d.Name, "total")
		ch <- prometheus.MustNewConstMetric(deviceMemDesc, prometheus.GaugeValue, float64(d.MemoryFree), d.Name, "free")
	}
	ch <- prometheus.MustNewConstMetric(gpuLayersDesc, prometheus.GaugeValue, float64(b.Info.GPULayers), c.s.cfg.ModelName)
	if ids := c.s.cfg.Adapters; len(ids) > 0 {
		with := func(counts []int) string {
			var names []string
			for i, n := range counts {
				if n > 0 && i < len(ids) {
					names = append(names, ids[i])
				}
			}
			return strings.Join(names, ",")
		}
		ch <- prometheus.MustNewConstMetric(loraInfoDesc, prometheus.GaugeValue, float64(time.Now().Unix()),
			with(l.AdapterRunning), with(l.AdapterWaiting), "1")
	}
}
