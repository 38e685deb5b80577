package api

import (
	"encoding/json"
	"net/http"
	"slices"
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

// infill is a fill-in-the-middle prompt in parts, tokenized, before it is laid
// out (tokens) and perhaps cut to fit (fit).
type infill struct {
	fim            engine.FIMTokens
	bos            []engine.Token
	head           []engine.Token   // the repository's name, after FIM_REP
	files          [][]engine.Token // each other file, its name first
	tail           []engine.Token   // the file being edited's name, before FIM_PRE
	prefix, suffix []engine.Token   // the prefix ends with the request's prompt
}

// newInfill tokenizes a fill-in-the-middle request's parts. Text is tokenized
// as text (control tokens written in the code stay text), and what follows a
// control token without the space a SentencePiece vocabulary puts before a
// text's first word (CodeLlama's reference encodes its suffix so); the prefix
// keeps it, as there. repo writes the repository layout where the model has
// its tokens (llama-server's /infill); without it, only the other files given
// are written, each after a line naming it.
func newInfill(v engine.Vocab, extra []InfillChunk, prefix, suffix, prompt string, repo bool) (*infill, error) {
	fim := v.FIM()
	if !fim.Infill() {
		return nil, invalid("", "this model has no fill-in-the-middle tokens (FIM_PRE, FIM_SUF, FIM_MID): it is not a code infill model")
	}
	in := &infill{fim: fim}
	if v.AddBOS() {
		in.bos = []engine.Token{v.BOS()}
	}
	var err error
	nl, nlErr := v.Tokenize("\n", false, false) // once, for every part's layout
	text := func(s string, space bool) []engine.Token {
		if s == "" || err != nil {
			return nil
		}
		var t []engine.Token
		if t, err = v.Tokenize(s, false, false); err != nil || space {
			return t
		}
		// Without the dummy space: tokenized after a newline, whose tokens are
		// then dropped (where they stay apart from the text's).
		both, berr := v.Tokenize("\n"+s, false, false)
		if nlErr == nil && berr == nil && len(both) > len(nl) && slices.Equal(both[:len(nl)], nl) {
			return both[len(nl):]
		}
		return t
	}
	sep := fim.Sep != engine.NoToken
	if repo && fim.Rep != engine.NoToken {
		in.head = append([]engine.Token{fim.Rep}, text(infillRepoName+"\n", false)...)
	}
	for _, ch := range extra {
		name := ch.Filename
		if name == "" {
			name = "tmp"
		}
		if sep {
			in.files = append(in.files, append([]engine.Token{fim.Sep}, text(name+"\n"+ch.Text, false)...))
		} else {
			in.files = append(in.files, text("\n\n--- "+name+" ---\n\n"+ch.Text, len(in.files) == 0 && len(in.head) == 0))
		}
	}
	if sep && (repo || len(extra) > 0) {
		in.tail = append([]engine.Token{fim.Sep}, text(infillFileName+"\n", false)...)
	}
	in.prefix = text(prefix+prompt, true) // the prompt is the cursor's line so far
	in.suffix = text(suffix, false)
	return in, err
}

// fit shortens in to at most budget tokens, as llama-server fits an infill
// request: the other files go first, the oldest (first given) first, then the
// prefix loses its start and the suffix its end, in a 3:1 share of what is
// left. It reports whether anything was cut.
func (in *infill) fit(budget int) bool {
	fixed := len(in.bos) + len(in.head) + len(in.tail) + 3
	files := 0
	for _, f := range in.files {
		files += len(f)
	}
	if fixed+files+len(in.prefix)+len(in.suffix) <= budget {
		return false
	}
	avail := max(budget-fixed, 0)
	suf := min(len(in.suffix), avail/4)
	pre := min(len(in.prefix), avail-suf)
	suf = min(len(in.suffix), avail-pre)
	in.prefix, in.suffix = in.prefix[len(in.prefix)-pre:], in.suffix[:suf]
	left := avail - pre - suf
	keep := len(in.files)
	for keep > 0 && len(in.files[keep-1]) <= left {
		left -= len(in.files[keep-1])
		keep--
	}
	in.files = in.files[keep:]
	return true
}

// tokens lays in out, prefix-suffix-middle as llama-server's /infill does:
// BOS; the repository's name, the other files and the edited file's name;
// FIM_PRE prefix FIM_SUF suffix FIM_MID. (BOS comes first, where
// llama-server writes it after the other files.)
func (in *infill) tokens() []engine.Token {
	out := slices.Concat(in.bos, in.head)
	for _, f := range in.files {
		out = append(out, f...)
	}
	out = append(out, in.tail...)
	out = append(append(append(out, in.fim.Pre), in.prefix...), in.fim.Suf)
	return append(append(out, in.suffix...), in.fim.Mid)
}

// InfillRequest is the body of POST /infill, llama-server's fill-in-the-middle
// endpoint, which llama.vim and llama.vscode call: the code before and after
// the cursor, other files as context, and llama-server's completion options
// (n_predict, repeat_penalty, n_indent, t_max_predict_ms; the OpenAI names
// work too; cache_prompt as on /completion). t_max_prompt_ms, of no use here,
// is accepted and ignored. Its samplers, "samplers" among them, are taken as on
// every endpoint (LlamaSamplerFields).
type InfillRequest struct {
	SamplingFields
	LlamaFields
	InputPrefix   string        `json:"input_prefix"`
	InputSuffix   string        `json:"input_suffix"`
	InputExtra    []InfillChunk `json:"input_extra"`
	Prompt        string        `json:"prompt"` // the start of the middle, after FIM_MID
	NIndent       int           `json:"n_indent"`
	TMaxPredictMS int           `json:"t_max_predict_ms"`
}

// InfillResponse is llama-server's answer to /infill and /completion, and the
// last event of their streams (the events before it are infillPieces).
type InfillResponse struct {
	Index           int            `json:"index"` // the prompt's, among /completion's several
	Content         string         `json:"content"`
	Stop            bool           `json:"stop"`
	Model           string         `json:"model,omitempty"`
	StopType        string         `json:"stop_type"` // eos, word (a stop string), limit
	StoppingWord    string         `json:"stopping_word"`
	TokensPredicted int            `json:"tokens_predicted"`
	TokensEvaluated int            `json:"tokens_evaluated"`
	TokensCached    int            `json:"tokens_cached"` // prompt tokens served from the prefix cache
	Truncated       bool           `json:"truncated"`
	Timings         *InfillTimings `json:"timings,omitempty"`
	// CompletionProbabilities are each token's log-probability and the likeliest
	// alternatives, when /completion's n_probs asks for them (each event its own).
	CompletionProbabilities []LlamaProb `json:"completion_probabilities,omitempty"`
}

// infillPiece is an event of the /infill and /completion streams before their
// last: the new text, and its tokens' probabilities when asked for.
type infillPiece struct {
	Index                   int         `json:"index"`
	Content                 string      `json:"content"`
	Stop                    bool        `json:"stop"`
	CompletionProbabilities []LlamaProb `json:"completion_probabilities,omitempty"`
}

// LlamaProb is a token of llama-server's completion_probabilities.
type LlamaProb struct {
	LlamaTopProb
	TopLogprobs []LlamaTopProb `json:"top_logprobs"`
}

// LlamaTopProb is a token and its log-probability, as llama-server names them.
type LlamaTopProb struct {
	ID      int     `json:"id"`
	Token   string  `json:"token"`
	Bytes   []int   `json:"bytes"`
	Logprob float32 `json:"logprob"`
}

// llamaProb is ev's token as completion_probabilities lists it.
func llamaProb(p *plan, v engine.Vocab, ev scheduler.Event) LlamaProb {
	tl := p.tokenLogprob(v, ev)
	out := LlamaProb{LlamaTopProb: LlamaTopProb{ID: int(ev.Token), Token: tl.Token, Bytes: tl.Bytes, Logprob: tl.Logprob},
		TopLogprobs: make([]LlamaTopProb, len(tl.TopLogprobs))}
	for i, t := range tl.TopLogprobs {
		out.TopLogprobs[i] = LlamaTopProb{ID: int(ev.Top[i].Token), Token: t.Token, Bytes: t.Bytes, Logprob: t.Logprob}
	}
	return out
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
// early (infillCut; /completion has neither), and how to answer.
type infillPlan struct {
	indent     int
	maxPredict time.Duration
	truncated  bool     // the request was cut to fit the context
	fields     []string // response_fields
}

// infillReserve is the room an /infill prompt leaves in the context for the
// completion when n_predict gives none (and the most it leaves when it does:
// half the context).
const infillReserve = 256

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
	p, maxTokens, warm, err := s.llamaPlan(b, &req.SamplingFields, &req.LlamaFields, "/infill")
	if err != nil {
		abort(c, err)
		return
	}
	in, err := newInfill(b.Vocab, req.InputExtra, req.InputPrefix, req.InputSuffix, req.Prompt, true)
	if err != nil {
		abort(c, err)
		return
	}
	// Cut to fit, as llama-server: the request is an editor's view around the
	// cursor, not a text to keep whole. The context ends the completion
	// (n_predict is a most, as there), so none is refused for its length.
	ctx := b.Generator.MaxContext()
	reserve := min(infillReserve, ctx/4)
	if maxTokens != nil {
		reserve = min(*maxTokens, ctx/2)
	}
	truncated := in.fit(ctx - reserve)
	p.prompts, p.warm, p.maxTokensAsked = [][]engine.Token{in.tokens()}, warm, false
	p.infill = &infillPlan{indent: req.NIndent, maxPredict: time.Duration(req.TMaxPredictMS) * time.Millisecond,
		truncated: truncated, fields: req.ResponseFields}
	s.routeOrRun(c, b, &p, forwarded)
}

// infillAnswer answers an /infill or /completion request in llama-server's
// format, whole or streamed (data events without [DONE], as llama-server's own
// endpoints): several prompts' answers as an array, and their events one
// prompt after another, each with its index.
func (s *Server) infillAnswer(c *gin.Context, b *Backend, p *plan, subs []submitted) {
	var w *sseWriter
	if p.stream {
		w = &sseWriter{c: c}
		w.start()
	}
	outs := make([]any, 0, len(subs))
	for i, sub := range subs {
		out, err := s.infillOne(c, b, p, sub, i, w)
		if err != nil {
			if w == nil {
				abort(c, err)
			} else if c.Request.Context().Err() == nil {
				w.data(toAPIError(err).body())
			}
			return
		}
		outs = append(outs, out)
	}
	switch {
	case w != nil:
	case len(outs) == 1:
		c.JSON(http.StatusOK, outs[0])
	default:
		c.JSON(http.StatusOK, outs)
	}
}

// infillOne reads sub, the answer to prompt index, sending its events to w
// when streaming: the last one carries out, the answer's end (whole, without
// w).
func (s *Server) infillOne(c *gin.Context, b *Backend, p *plan, sub submitted, index int, w *sseWriter) (out any, err error) {
	var content strings.Builder
	var probs []LlamaProb   // not yet sent
	var emitted, pieces int // bytes of the answer's text, of its tokens'
	emit := func(text string) {
		emitted += len(text)
		if text == "" && len(probs) == 0 {
			return
		}
		if w != nil {
			w.data(infillPiece{Index: index, Content: text, CompletionProbabilities: probs})
			probs = nil
			return
		}
		content.WriteString(text)
	}
	cut := infillCut{infillPlan: *p.infill}
	var times tokenTimes
	var fin scheduler.Event
	u, err := s.drain(c.Request.Context(), b, p, sub, func(ev scheduler.Event) {
		times.see(ev)
		if p.warm {
			return // max_tokens 0: the token drawn is not the answer's
		}
		switch ev.Kind {
		case scheduler.EventToken:
			if p.logprobs {
				probs = append(probs, llamaProb(p, b.Vocab, ev))
				if !ev.EndOfGeneration { // listed, but its text is none of the answer's
					pieces += len(probs[len(probs)-1].Bytes)
				}
			}
			elapsed := ev.At.Sub(times.first)
			if ev.EndOfGeneration {
				elapsed = 0 // the end, which wins over a time cut, as llama-server's
			}
			text, how := cut.add(ev.Text, elapsed)
			switch how {
			case cutIndent: // what the scheduler holds comes after the cut
				sub.stream.Stop(ev.Index)
			case cutTime: // and here before it
				sub.stream.Cut(ev.Index)
			}
			emit(text)
		case scheduler.EventFinish:
			fin = ev
			text := ev.Text // held back by the scheduler until a time cut
			if !cut.timeUp {
				text, _ = cut.add(ev.Text, 0)
			}
			emit(text + cut.end())
		}
	})
	if err != nil {
		return nil, err
	}
	// The tokens whose text a stop string (or a cut) took out of the answer are
	// not listed, as llama-server does not list them: those not yet sent.
	for excess := pieces - emitted; excess > 0 && len(probs) > 0; probs = probs[:len(probs)-1] {
		excess -= len(probs[len(probs)-1].Bytes)
	}
	r := InfillResponse{Index: index, Content: content.String(), Stop: true, Model: p.model, TokensPredicted: u.CompletionTokens,
		TokensEvaluated: u.PromptTokens, TokensCached: u.CachedTokens, CompletionProbabilities: probs}
	switch {
	case p.warm || cut.stopped || fin.Finish == scheduler.FinishLength:
		r.StopType = "limit"
	case fin.StopString != "":
		r.StopType, r.StoppingWord = "word", fin.StopString
	default:
		r.StopType = "eos"
	}
	t := InfillTimings{PromptN: u.PromptTokens - u.CachedTokens, PredictedN: u.CompletionTokens}
	t.PromptMS, t.PredictedMS = ms(times.prompt(sub, u)), ms(times.generating())
	t.PromptPerSecond, t.PredictedPerSecond = perSecond(t.PromptN, t.PromptMS), perSecond(t.PredictedN, t.PredictedMS)
	r.Timings, r.Truncated = &t, p.infill.truncated
	if w != nil {
		r.Content = ""
	}
	out = r
	if len(p.infill.fields) > 0 {
		out = selectFields(r, p.infill.fields)
	}
	if w != nil {
		w.data(out)
	}
	return out, nil
}

// selectFields is v as JSON with only the fields at paths, each under its path
// ("timings/prompt_n" for a nested one), as llama-server answers
// response_fields; a path v lacks is left out.
func selectFields(v any, paths []string) map[string]any {
	var all map[string]any
	b, _ := json.Marshal(v)
	_ = json.Unmarshal(b, &all)
	out := map[string]any{}
	for _, path := range paths {
		var at any = all
		for _, k := range strings.Split(path, "/") {
			m, ok := at.(map[string]any)
			if !ok {
				at = nil
				break
			}
			if at, ok = m[k]; !ok {
				break
			}
		}
		if at != nil {
			out[path] = at
		}
	}
	return out
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
	timeUp   bool // stopped by maxPredict
}

// cutKind is why infillCut.add stopped a completion.
type cutKind uint8

const (
	cutNone   cutKind = iota
	cutIndent         // a line indented less than n_indent
	cutTime           // t_max_predict_ms passed
)

// add takes a token's text, generated elapsed after the first token, and
// returns what of it to pass on, and whether and why the completion stops here.
func (f *infillCut) add(text string, elapsed time.Duration) (out string, stop cutKind) {
	if f.stopped {
		return "", cutNone
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
				return b.String(), cutIndent
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
		f.stopped, f.timeUp = true, true
		b.WriteString(f.held.String())
		f.held.Reset()
		return b.String(), cutTime
	}
	return b.String(), cutNone
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
