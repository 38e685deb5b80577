package api

import (
	"fmt"
	"net/http"
	"strings"
	"time"

	"github.com/gin-gonic/gin"

	"github.com/shoal-ai/shoal/engine"
	"github.com/shoal-ai/shoal/scheduler"
)

// InfillChunk is another file of the repository given as context for a
// fill-in-the-middle request (llama-server's input_extra).
type InfillChunk struct {
	Filename string `json:"filename"`
	Text     string `json:"text"`
}

// MaxInfillChunks bounds input_extra.
const MaxInfillChunks = 1024

// Names the repository-level layout writes where a request gives none, as
// llama-server writes them (Qwen2.5-Coder's repo-level pattern: a repository
// name, then each file after its path).
const (
	infillRepoName = "myproject"
	infillFileName = "filename"
)

// infillPrompt lays out a fill-in-the-middle prompt, prefix-suffix-middle as
// llama-server's /infill does: BOS where the model wants one; the other files
// of the repository, if any, after the model's repository and file-separator
// tokens (Qwen2.5-Coder's repo-level layout) or, without them, each after a
// line naming it; then FIM_PRE prefix FIM_SUF suffix FIM_MID, and the start of
// the middle if given. Text is tokenized as text: control tokens written in
// the code stay text. It fails for a model without FIM tokens.
func infillPrompt(v engine.Vocab, extra []InfillChunk, prefix, suffix, middle string) ([]engine.Token, error) {
	fim := v.FIM()
	if !fim.Infill() {
		return nil, fmt.Errorf("this model has no fill-in-the-middle tokens (FIM_PRE, FIM_SUF, FIM_MID): it is not a code infill model")
	}
	var out []engine.Token
	if v.AddBOS() {
		out = append(out, v.BOS())
	}
	text := func(s string) error {
		if s == "" {
			return nil
		}
		t, err := v.Tokenize(s, false, false)
		out = append(out, t...)
		return err
	}
	if len(extra) > 0 {
		if fim.Repo() {
			out = append(out, fim.Rep)
			if err := text(infillRepoName + "\n"); err != nil {
				return nil, err
			}
		}
		for _, ch := range extra {
			name := ch.Filename
			if name == "" {
				name = "tmp"
			}
			if fim.Repo() {
				out = append(out, fim.Sep)
				if err := text(name + "\n" + ch.Text); err != nil {
					return nil, err
				}
				continue
			}
			if err := text("\n\n--- " + name + " ---\n\n" + ch.Text); err != nil {
				return nil, err
			}
		}
		if fim.Repo() {
			out = append(out, fim.Sep)
			if err := text(infillFileName + "\n"); err != nil {
				return nil, err
			}
		}
	}
	out = append(out, fim.Pre)
	if err := text(prefix); err != nil {
		return nil, err
	}
	out = append(out, fim.Suf)
	if err := text(suffix); err != nil {
		return nil, err
	}
	out = append(out, fim.Mid)
	if err := text(middle); err != nil {
		return nil, err
	}
	return out, nil
}

// InfillRequest is the body of POST /infill, llama-server's fill-in-the-middle
// endpoint, which llama.vim and llama.vscode call: the code before and after
// the cursor, other files as context, and llama-server's completion options
// (n_predict, repeat_penalty, n_indent, t_max_predict_ms; the OpenAI names
// work too). Options of llama-server's own that shoal has no use for
// (cache_prompt, samplers, t_max_prompt_ms) are accepted and ignored: the
// prefix cache is always on.
type InfillRequest struct {
	SamplingFields
	InputPrefix   string        `json:"input_prefix"`
	InputSuffix   string        `json:"input_suffix"`
	InputExtra    []InfillChunk `json:"input_extra"`
	Prompt        string        `json:"prompt"` // the start of the middle, after FIM_MID
	NPredict      *int          `json:"n_predict"`
	RepeatPenalty *float64      `json:"repeat_penalty"`
	NIndent       int           `json:"n_indent"`
	TMaxPredictMS int           `json:"t_max_predict_ms"`
}

// InfillResponse is llama-server's answer to /infill, and each event of its
// stream: Content is the new text and Stop false until the last event, which
// carries the rest.
type InfillResponse struct {
	Content         string         `json:"content"`
	Stop            bool           `json:"stop"`
	Model           string         `json:"model,omitempty"`
	StopType        string         `json:"stop_type,omitempty"` // eos, word (a stop string), limit
	StoppingWord    string         `json:"stopping_word,omitempty"`
	TokensPredicted int            `json:"tokens_predicted,omitempty"`
	TokensEvaluated int            `json:"tokens_evaluated,omitempty"`
	TokensCached    int            `json:"tokens_cached,omitempty"` // prompt tokens served from the prefix cache
	Truncated       bool           `json:"truncated"`
	Timings         *InfillTimings `json:"timings,omitempty"`
}

// InfillTimings are llama-server's timings of a request.
type InfillTimings struct {
	PromptN            int     `json:"prompt_n"` // prompt tokens computed (not cached)
	PromptMS           float64 `json:"prompt_ms"`
	PromptPerSecond    float64 `json:"prompt_per_second"`
	PredictedN         int     `json:"predicted_n"`
	PredictedMS        float64 `json:"predicted_ms"`
	PredictedPerSecond float64 `json:"predicted_per_second"`
}

// infillPlan holds an /infill request's two ways of ending a code completion
// early (infillCut).
type infillPlan struct {
	indent     int
	maxPredict time.Duration
}

func (s *Server) infill(c *gin.Context) {
	var req InfillRequest
	b, forwarded, ok := s.beginGeneration(c, &req, &req.Model, &req.Priority)
	if !ok {
		return
	}
	if !b.Vocab.FIM().Infill() {
		abort(c, invalid("input_prefix", "this model has no fill-in-the-middle tokens (FIM_PRE, FIM_SUF, FIM_MID): /infill needs a code infill model"))
		return
	}
	switch {
	case req.N != nil && *req.N != 1:
		abort(c, invalid("n", "/infill answers one completion"))
		return
	case len(req.InputExtra) > MaxInfillChunks:
		abort(c, invalid("input_extra", "at most %d input_extra chunks are allowed, got %d", MaxInfillChunks, len(req.InputExtra)))
		return
	case req.NIndent < 0:
		abort(c, invalid("n_indent", "n_indent must not be negative, got %d", req.NIndent))
		return
	case req.TMaxPredictMS < 0:
		abort(c, invalid("t_max_predict_ms", "t_max_predict_ms must not be negative, got %d", req.TMaxPredictMS))
		return
	}
	// n_predict, else max_tokens: -1 generates until the end, as llama-server's
	// default; 0 computes the prompt and answers nothing (llama.vscode warms the
	// cache with its context so).
	maxTokens, param := req.MaxTokens, "max_tokens"
	if req.NPredict != nil {
		maxTokens, param = req.NPredict, "n_predict"
	}
	warm := false
	if maxTokens != nil && *maxTokens <= 0 {
		if *maxTokens < -1 {
			abort(c, invalid(param, "%s must be -1 (until the end), 0 (the prompt alone) or more, got %d", param, *maxTokens))
			return
		}
		if *maxTokens == 0 {
			one := 1
			maxTokens, warm = &one, true
		} else {
			maxTokens = nil
		}
	}
	if req.RepetitionPenalty == nil {
		req.RepetitionPenalty = req.RepeatPenalty
	}
	p, err := s.samplingPlan(b, &req.SamplingFields, param, maxTokens)
	if err != nil {
		abort(c, err)
		return
	}
	toks, err := infillPrompt(b.Vocab, req.InputExtra, req.InputPrefix, req.InputSuffix, req.Prompt)
	if err != nil {
		abort(c, err)
		return
	}
	p.prompts, p.warm = [][]engine.Token{toks}, warm
	p.infill = &infillPlan{indent: req.NIndent, maxPredict: time.Duration(req.TMaxPredictMS) * time.Millisecond}
	s.routeOrRun(c, b, &p, forwarded)
}

// infillAnswer answers an /infill request in llama-server's format, whole or
// streamed (data events without [DONE], as llama-server's own endpoints).
func (s *Server) infillAnswer(c *gin.Context, b *Backend, p *plan, sub submitted) {
	var w *sseWriter
	if p.stream {
		w = &sseWriter{c: c}
		w.start()
	}
	var content strings.Builder
	emit := func(text string) {
		if text == "" {
			return
		}
		if w != nil {
			w.data(InfillResponse{Content: text})
			return
		}
		content.WriteString(text)
	}
	cut := infillCut{infillPlan: *p.infill}
	var first, last time.Time
	var fin scheduler.Event
	u, err := s.drain(c.Request.Context(), b, p, sub, func(ev scheduler.Event) {
		if ev.Kind == scheduler.EventToken {
			if first.IsZero() {
				first = ev.At
			}
			last = ev.At
		}
		if p.warm {
			return // max_tokens 0: the token drawn is not the answer's
		}
		switch ev.Kind {
		case scheduler.EventToken:
			text, stop := cut.add(ev.Text, ev.At.Sub(first))
			if stop {
				sub.stream.Stop(ev.Index)
			}
			emit(text)
		case scheduler.EventFinish:
			fin = ev
			text, _ := cut.add(ev.Text, 0)
			emit(text + cut.end())
		}
	})
	if err != nil {
		if w == nil {
			abort(c, err)
		} else if c.Request.Context().Err() == nil {
			w.data(toAPIError(err).body())
		}
		return
	}
	r := InfillResponse{Content: content.String(), Stop: true, Model: p.model, TokensPredicted: u.CompletionTokens,
		TokensEvaluated: u.PromptTokens, TokensCached: u.CachedTokens}
	switch {
	case p.warm || cut.stopped || fin.Finish == scheduler.FinishLength:
		r.StopType = "limit"
	case fin.StopString != "":
		r.StopType, r.StoppingWord = "word", fin.StopString
	default:
		r.StopType = "eos"
	}
	t := InfillTimings{PromptN: u.PromptTokens - u.CachedTokens, PredictedN: u.CompletionTokens}
	if !first.IsZero() {
		t.PromptMS = ms(first.Sub(sub.start) - u.QueueTime)
		t.PredictedMS = ms(last.Sub(first))
	}
	t.PromptPerSecond, t.PredictedPerSecond = perSecond(t.PromptN, t.PromptMS), perSecond(t.PredictedN, t.PredictedMS)
	r.Timings = &t
	if w != nil {
		r.Content = ""
		w.data(r)
		return
	}
	c.JSON(http.StatusOK, r)
}

func ms(d time.Duration) float64 { return float64(max(d, 0).Microseconds()) / 1000 }

func perSecond(n int, ms float64) float64 {
	if ms <= 0 {
		return 0
	}
	return float64(n) / ms * 1000
}

// infillCut ends a code completion where llama-server's two options end it:
// with indent set, at the first line (after the first line break) indented
// less than indent, cut before its text (the completion has left the block
// being written); with maxPredict set, at the first token past that long
// after the first token, once the completion has a line break. Once it has
// stopped, the text that still comes is dropped.
type infillCut struct {
	infillPlan
	held     strings.Builder // a line's leading spaces and tabs, while indent may cut it
	deciding bool            // after a line break, before the line's first other character
	broken   bool            // a line break was written
	stopped  bool
}

// add takes a token's text, generated elapsed after the first token, and
// returns what of it to pass on, and whether the completion stops here.
func (f *infillCut) add(text string, elapsed time.Duration) (out string, stop bool) {
	if f.stopped {
		return "", false
	}
	var b strings.Builder
	for _, r := range text {
		if f.deciding {
			switch r {
			case ' ', '\t':
				f.held.WriteRune(r)
				continue
			case '\n':
				b.WriteString(f.held.String()) // a blank line says nothing of the block
				f.held.Reset()
				b.WriteRune(r)
				continue
			}
			if f.held.Len() < f.indent {
				f.stopped = true
				f.held.Reset()
				return b.String(), true
			}
			b.WriteString(f.held.String())
			f.held.Reset()
			f.deciding = false
		}
		b.WriteRune(r)
		if r == '\n' {
			f.broken, f.deciding = true, f.indent > 0
		}
	}
	if f.maxPredict > 0 && f.broken && elapsed > f.maxPredict {
		f.stopped = true
		f.held.Reset()
		return b.String(), true
	}
	return b.String(), false
}

// end is the text held at the completion's natural end: the spaces of a last
// line not yet decided.
func (f *infillCut) end() string {
	if f.stopped {
		return ""
	}
	s := f.held.String()
	f.held.Reset()
	return s
}
