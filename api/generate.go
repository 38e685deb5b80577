package api

import (
	"cmp"
	"context"
	crand "crypto/rand"
	"encoding/binary"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"math"
	"net/http"
	"reflect"
	"slices"
	"strconv"
	"strings"
	"time"
	"unicode"
	"unicode/utf8"

	"github.com/gin-gonic/gin"

	"github.com/shoal-ai/shoal/cluster"
	"github.com/shoal-ai/shoal/engine"
	"github.com/shoal-ai/shoal/engine/sample"
	"github.com/shoal-ai/shoal/scheduler"
)

// bodyKey holds the raw request body in the gin context, for forwarding.
const bodyKey = "shoal.body"

// decodeBody reads a JSON request body into v with OpenAI-style errors.
func decodeBody(c *gin.Context, v any) error {
	body, err := io.ReadAll(c.Request.Body)
	if err != nil {
		return err // MaxBytesError maps to 413
	}
	c.Set(bodyKey, body)
	if limit := c.GetInt64(imageBodyKey); limit > 0 && int64(len(body)) > limit && !mayCarryImages(body) {
		return &http.MaxBytesError{Limit: limit} // the larger limit is for pictures
	}
	if len(body) == 0 {
		return invalid("", "request body is empty; expected a JSON object")
	}
	if err := json.Unmarshal(body, v); err != nil {
		var fe *fieldError
		if errors.As(err, &fe) {
			return invalid(fe.param, "%v", fe.err)
		}
		var te *json.UnmarshalTypeError
		if errors.As(err, &te) {
			field := jsonField(te.Field)
			if field == "" {
				return invalid("", "the request body must be a JSON object, got JSON %s", te.Value)
			}
			return invalid(field, "field %q: expected %s, got JSON %s", field, jsonTypeName(te.Type), te.Value)
		}
		return invalid("", "invalid JSON body: %v", err)
	}
	return nil
}

// jsonTypeName is what a field of type t holds, in JSON's words.
func jsonTypeName(t reflect.Type) string {
	switch t {
	case reflect.TypeFor[StringOrList]():
		return "a string or an array of strings"
	case reflect.TypeFor[Prompt]():
		return "a string, an array of strings, an array of token ids, or an array of such arrays"
	case reflect.TypeFor[Content]():
		return "a string or an array of content parts"
	}
	switch t.Kind() {
	case reflect.String:
		return "a string"
	case reflect.Bool:
		return "a boolean"
	case reflect.Int, reflect.Int8, reflect.Int16, reflect.Int32, reflect.Int64, reflect.Uint, reflect.Uint8, reflect.Uint16, reflect.Uint32, reflect.Uint64:
		return "an integer"
	case reflect.Float32, reflect.Float64:
		return "a number"
	case reflect.Slice, reflect.Array:
		return "an array"
	case reflect.Struct, reflect.Map:
		return "an object"
	case reflect.Pointer:
		return jsonTypeName(t.Elem())
	}
	return "another JSON value"
}

// jsonField is a decoding error's field path as the client wrote it: without
// the names of the Go structs it passed through ("ToolFields.tools" → "tools").
func jsonField(path string) string {
	parts := strings.Split(path, ".")
	out := parts[:0]
	for _, p := range parts {
		if r, _ := utf8.DecodeRuneInString(p); !unicode.IsUpper(r) {
			out = append(out, p)
		}
	}
	return strings.Join(out, ".")
}

// plan is a validated generation request ready for the scheduler.
type plan struct {
	prompts [][]engine.Token
	echo    []string // per prompt, when echo is set
	req     scheduler.Request
	n       int
	stream  bool
	usage   bool // stream_options.include_usage
	// continuousUsage: every chunk carries the usage so far
	// (stream_options.continuous_usage_stats, with include_usage).
	continuousUsage bool
	// truncate keeps each prompt's last truncate tokens (truncate_prompt_tokens;
	// -1: as many as the context leaves room for a token; 0: all).
	truncate int
	logprobs bool
	top      int
	// promptScores answers with the prompt's scores (prompt_logprobs, with
	// promptTop alternatives); echoScores puts them in an echoed prompt's
	// completions logprobs (echo with logprobs).
	promptScores, echoScores bool
	promptTop                int
	tokenIDs                 bool // logprobs name tokens by id (return_tokens_as_token_ids)
	model                    string
	chat                     bool
	completes                bool // legacy completions logprobs format
	anthropic                bool // answered as Anthropic's Messages API
	// warm: max_tokens 0, the prompt computed (and one token drawn, unseen), the
	// answer empty: Anthropic's (which warms the cache), and completions' with
	// echo (the prompt alone, scored with logprobs: vLLM's).
	warm bool
	// params names the chat fields a translated request (anthropic, responses)
	// has under other names, for its errors.
	params    map[string]string
	responses *ResponsesRequest // answered as OpenAI's Responses API
	infill    *infillPlan       // answered as llama-server's /infill and /completion
	ollama    *ollamaPlan       // answered as Ollama's /api/chat or /api/generate
	tools     *toolPlan         // chat answers follow the tool protocol
	think     *thinkPlan        // chat answers' thoughts are passed on apart
	// grammarParam is the request field req.Grammar comes from.
	grammarParam string
	// maxTokensAsked: the request gave max_tokens (a default filled in is not
	// checked against the context; the context cuts it short instead).
	maxTokensAsked bool
	// maxTokens is the max_tokens the request gave, under the name it gave
	// it as, for the node's cap (--max-tokens-cap), checked where it runs:
	// a cluster routes it to a node whose cap it fits.
	maxTokens      int
	maxTokensParam string
	// finished counts the choices whose finish was read (and counted in metrics).
	finished int
	// images is the prompt with its images, computed where the request runs
	// (imagePrompt); prompts[0] is then the text around them, for routing.
	images *imagePlan
}

// param is chat field name as p's request names it.
func (p *plan) param(name string) string {
	if n, ok := p.params[name]; ok {
		return n
	}
	return name
}

// samplingPlan validates the shared fields into a scheduler.Request template.
// maxTokens is the request's max_tokens under the name it was given as (param).
func (s *Server) samplingPlan(b *Backend, f *SamplingFields, param string, maxTokens *int) (plan, error) {
	var p plan
	if err := s.checkModel(f.Model); err != nil {
		return p, err
	}
	p.model = s.cfg.ModelName
	if a, _ := s.adapterOf(f.Model); a > 0 {
		p.model, p.req.Adapter = f.Model, a
	}
	p.stream = f.Stream
	if f.StreamOptions != nil {
		if !f.Stream {
			return p, invalid("stream_options", "stream_options is only allowed with stream: true")
		}
		p.usage = f.StreamOptions.IncludeUsage
		p.continuousUsage = p.usage && f.StreamOptions.ContinuousUsageStats
	}
	if f.UseBeamSearch {
		return p, invalid("use_beam_search", "beam search is not served (vLLM serves it apart from its sampling API): ask for n choices with logprobs and keep those whose logprobs sum highest")
	}
	if k := f.TruncatePromptTokens; k != nil {
		if *k < -1 || *k == 0 {
			return p, invalid("truncate_prompt_tokens", "truncate_prompt_tokens must be -1 (as many as the context takes) or at least 1, got %d", *k)
		}
		p.truncate = *k
	}
	p.n = 1
	if f.N != nil {
		if *f.N < 1 || *f.N > scheduler.MaxChoices {
			return p, invalid("n", "n must be between 1 and %d, got %d", scheduler.MaxChoices, *f.N)
		}
		p.n = *f.N
	}
	r := &p.req
	r.N = p.n
	if maxTokens != nil {
		if *maxTokens < 1 {
			return p, invalid(param, "%s must be at least 1, got %d", param, *maxTokens)
		}
		r.MaxTokens, p.maxTokensAsked = *maxTokens, true
		p.maxTokens, p.maxTokensParam = *maxTokens, param
	}
	if len(f.Stop) > MaxStops {
		return p, invalid("stop", "at most %d stop strings are allowed, got %d", MaxStops, len(f.Stop))
	}
	for _, st := range f.Stop {
		if st == "" {
			return p, invalid("stop", "stop strings must not be empty")
		}
		if len(st) > scheduler.MaxStopBytes {
			return p, invalid("stop", "a stop string may hold at most %d bytes, got %d", scheduler.MaxStopBytes, len(st))
		}
	}
	r.Stop = f.Stop
	r.IncludeStop = f.IncludeStopStr
	if len(f.StopTokenIDs) > MaxStopTokens {
		return p, invalid("stop_token_ids", "at most %d stop token ids are allowed, got %d", MaxStopTokens, len(f.StopTokenIDs))
	}
	for _, id := range f.StopTokenIDs {
		if id < 0 || id >= b.Vocab.Size() {
			return p, invalid("stop_token_ids", "stop token id %d is not a token id of this model (0..%d)", id, b.Vocab.Size()-1)
		}
		r.StopTokens = append(r.StopTokens, engine.Token(id))
	}
	if f.MinTokens != nil {
		if *f.MinTokens < 0 {
			return p, invalid("min_tokens", "min_tokens must not be negative, got %d", *f.MinTokens)
		}
		if maxTokens != nil && *f.MinTokens > *maxTokens {
			return p, invalid("min_tokens", "min_tokens %d exceeds %s %d", *f.MinTokens, param, *maxTokens)
		}
		r.MinTokens = *f.MinTokens
	}
	if k := f.PromptLogprobs; k != nil {
		switch {
		case *k < 0 || *k > sample.MaxTopLogprobs:
			// vLLM's -1 (the whole vocabulary) too: a list as long as the vocabulary per token.
			return p, invalid("prompt_logprobs", "prompt_logprobs must be between 0 and %d, got %d", sample.MaxTopLogprobs, *k)
		case f.Stream:
			return p, invalid("prompt_logprobs", "prompt_logprobs is not available with stream: true")
		}
		r.PromptLogprobs, r.PromptTopLogprobs = true, *k
		p.promptScores, p.promptTop = true, *k
	}
	p.tokenIDs = f.ReturnTokensAsTokenIDs
	r.IgnoreEOS = f.IgnoreEOS
	r.SpecialTokens = f.SkipSpecialTokens != nil && !*f.SkipSpecialTokens
	if f.Priority != nil {
		r.Priority = *f.Priority
	}
	d := engine.SamplingDefaults{Temperature: f.Temperature, TopP: f.TopP, TopK: f.TopK, MinP: f.MinP, RepeatPenalty: f.RepetitionPenalty}.Over(b.Sampling)
	maxTemp := 2.0
	if f.llamaRanges {
		maxTemp = math.Inf(1)
	}
	if err := validateSampling(d, maxTemp); err != nil {
		return p, err
	}
	sp := samplingParams(d)
	for name, v := range map[string]*float64{"presence_penalty": f.PresencePenalty, "frequency_penalty": f.FrequencyPenalty} {
		if v != nil && (math.IsNaN(*v) || *v < -2 || *v > 2) {
			return p, invalid(name, "%s must be between -2 and 2, got %v", name, *v)
		}
	}
	if n := f.RepeatLastN; n != nil {
		switch {
		case *n < -1:
			return p, invalid("repeat_last_n", "repeat_last_n must be -1 (the whole sequence), 0 (no repetition penalty) or more, got %d", *n)
		case *n == 0:
			sp.RepeatPenalty = 1 // a window of nothing, as llama.cpp's
		default:
			sp.RepeatLastN = *n
		}
	}
	if f.PresencePenalty != nil {
		sp.PresencePenalty = float32(*f.PresencePenalty)
	}
	if f.FrequencyPenalty != nil {
		sp.FrequencyPenalty = float32(*f.FrequencyPenalty)
	}
	if f.Seed != nil {
		sp.Seed = uint64(*f.Seed)
	} else {
		var buf [8]byte
		_, _ = crand.Read(buf[:])
		sp.Seed = binary.LittleEndian.Uint64(buf[:])
	}
	var err error
	if len(f.LogitBias) > 0 {
		if sp.LogitBias, err = f.LogitBias.tokens(b.Vocab); err != nil {
			return p, err
		}
	}
	if err := b.llamaSamplers(&f.LlamaSamplerFields, &sp); err != nil {
		return p, err
	}
	if sp.Allowed, sp.BadWords, err = vllmTokens(b.Vocab, f); err != nil {
		return p, err
	}
	r.Sampling = sp
	if p.grammarParam, r.Grammar, err = s.grammarFor(b.Vocab, f); err != nil {
		return p, err
	}
	return p, nil
}

// vllmTokens reads vLLM's allowed_token_ids and bad_words: each bad word as
// it is tokenized alone and after a space, as vLLM bans it.
func vllmTokens(v engine.Vocab, f *SamplingFields) (allowed []engine.Token, bad [][]engine.Token, err error) {
	if f.AllowedTokenIDs != nil && len(f.AllowedTokenIDs) == 0 {
		return nil, nil, invalid("allowed_token_ids", "allowed_token_ids is empty: no token could be drawn (leave it out for any)")
	}
	if len(f.AllowedTokenIDs) > v.Size() {
		return nil, nil, invalid("allowed_token_ids", "at most %d token ids (the vocabulary), got %d", v.Size(), len(f.AllowedTokenIDs))
	}
	for _, id := range f.AllowedTokenIDs {
		if id < 0 || id >= v.Size() {
			return nil, nil, invalid("allowed_token_ids", "allowed token id %d is not a token id of this model (0..%d)", id, v.Size()-1)
		}
		allowed = append(allowed, engine.Token(id))
	}
	if len(f.BadWords) > MaxStops {
		return nil, nil, invalid("bad_words", "at most %d bad words are allowed, got %d", MaxStops, len(f.BadWords))
	}
	for _, w := range f.BadWords {
		w = strings.TrimLeftFunc(w, unicode.IsSpace)
		if w == "" || len(w) > scheduler.MaxStopBytes {
			return nil, nil, invalid("bad_words", "a bad word must hold 1 to %d bytes (besides leading spaces), got %d", scheduler.MaxStopBytes, len(w))
		}
		for _, text := range []string{w, " " + w} {
			toks, err := v.Tokenize(text, false, false)
			if err != nil {
				return nil, nil, invalid("bad_words", "bad word %q: %v", w, err)
			}
			if len(toks) > 0 && !slices.ContainsFunc(bad, func(b []engine.Token) bool { return slices.Equal(b, toks) }) {
				bad = append(bad, toks)
			}
		}
	}
	return allowed, bad, nil
}

// ValidateSampling checks sampling parameters against the ranges OpenAI and vLLM
// hold requests to; its errors name the request field.
func ValidateSampling(d engine.SamplingDefaults) error {
	return validateSampling(d, 2)
}

// validateSampling is ValidateSampling with temperatures up to maxTemp.
func validateSampling(d engine.SamplingDefaults, maxTemp float64) error {
	bad := func(v *float64, lo, hi float64, loOpen bool) bool {
		return v != nil && (math.IsNaN(*v) || *v < lo || *v > hi || loOpen && *v == lo)
	}
	switch {
	case bad(d.Temperature, 0, maxTemp, false):
		return invalid("temperature", "temperature must be between 0 and %v, got %v", maxTemp, *d.Temperature)
	case bad(d.TopP, 0, 1, true):
		return invalid("top_p", "top_p must be in (0, 1], got %v", *d.TopP)
	case d.TopK != nil && *d.TopK < -1:
		return invalid("top_k", "top_k must be -1 (off), 0 (off) or positive, got %d", *d.TopK)
	case bad(d.MinP, 0, 1, false):
		return invalid("min_p", "min_p must be between 0 and 1, got %v", *d.MinP)
	case bad(d.RepeatPenalty, 0, 10, true):
		return invalid("repetition_penalty", "repetition_penalty must be in (0, 10], got %v", *d.RepeatPenalty)
	}
	return nil
}

// samplingParams are d's parameters with OpenAI's defaults (temperature 1, the
// whole vocabulary) where d says nothing.
func samplingParams(d engine.SamplingDefaults) sample.Params {
	sp := sample.Params{Temperature: 1}
	if d.Temperature != nil {
		sp.Temperature = float32(*d.Temperature)
	}
	if d.TopP != nil {
		sp.TopP = float32(*d.TopP)
	}
	if d.TopK != nil {
		sp.TopK = max(*d.TopK, 0)
	}
	if d.MinP != nil {
		sp.MinP = float32(*d.MinP)
	}
	if d.RepeatPenalty != nil {
		sp.RepeatPenalty = float32(*d.RepeatPenalty)
	}
	return sp
}

// constraint is an output constraint a request names: a JSON schema (raw, as
// given), a choice among strings, a regular expression the output matches
// whole, or a GBNF grammar (grammar set, or regex nil and the others empty).
type constraint struct {
	param   string
	schema  json.RawMessage
	choices []string
	regex   *string
	grammar string
}

// constraintOf is the one output constraint a request names, if any:
// response_format, or the same constraints as vLLM and llama-server spell them.
func constraintOf(f *SamplingFields) (*constraint, error) {
	var cs []constraint
	if rf := f.ResponseFormat; rf != nil {
		switch rf.Type {
		case "", "text":
		case "json_object":
			if present(rf.Schema) {
				cs = append(cs, constraint{param: "response_format", schema: rf.Schema}) // llama-server's form
			} else {
				cs = append(cs, constraint{param: "response_format", schema: json.RawMessage(`{"type":"object"}`)})
			}
		case "json_schema":
			if rf.JSONSchema == nil || len(rf.JSONSchema.Schema) == 0 {
				return nil, invalid("response_format", "response_format json_schema needs json_schema.schema")
			}
			cs = append(cs, constraint{param: "response_format", schema: rf.JSONSchema.Schema})
		default:
			return nil, invalid("response_format", "response_format type %q: want text, json_object or json_schema", rf.Type)
		}
	}
	if present(f.GuidedJSON) {
		cs = append(cs, constraint{param: "guided_json", schema: f.GuidedJSON})
	}
	if f.GuidedChoice != nil {
		cs = append(cs, constraint{param: "guided_choice", choices: f.GuidedChoice})
	}
	if present(f.JSONSchema) {
		cs = append(cs, constraint{param: "json_schema", schema: f.JSONSchema})
	}
	if so := f.StructuredOutputs; so != nil {
		if present(so.JSON) {
			cs = append(cs, constraint{param: "structured_outputs", schema: so.JSON})
		}
		if so.Choice != nil {
			cs = append(cs, constraint{param: "structured_outputs", choices: so.Choice})
		}
		if so.Regex != nil {
			cs = append(cs, constraint{param: "structured_outputs", regex: so.Regex})
		}
		if so.Grammar != nil {
			cs = append(cs, constraint{param: "structured_outputs", grammar: *so.Grammar})
		}
		if so.JSONObject {
			cs = append(cs, constraint{param: "structured_outputs", schema: json.RawMessage(`{"type":"object"}`)})
		}
		if present(so.StructuralTag) {
			return nil, invalid("structured_outputs", "structured_outputs.structural_tag is not supported: use json, choice, regex, grammar or json_object")
		}
	}
	if f.GuidedRegex != nil {
		cs = append(cs, constraint{param: "guided_regex", regex: f.GuidedRegex})
	}
	if f.GuidedGrammar != nil {
		cs = append(cs, constraint{param: "guided_grammar", grammar: *f.GuidedGrammar})
	}
	if f.Grammar != nil && *f.Grammar != "" { // llama-server's clients send "" for none
		cs = append(cs, constraint{param: "grammar", grammar: *f.Grammar})
	}
	switch {
	case len(cs) == 0:
		return nil, nil
	case len(cs) > 1:
		return nil, invalid(cs[1].param, "at most one output constraint per request: %s and %s were both given", cs[0].param, cs[1].param)
	}
	return &cs[0], nil
}

// grammarFor is the grammar of f's output constraint, if it has one, and the
// field that asked for it. A client's grammar or regular expression is
// checked and bounded (engine.ParseGBNF) before llama.cpp's parser sees it.
func (s *Server) grammarFor(v engine.Vocab, f *SamplingFields) (param, gbnf string, err error) {
	c, err := constraintOf(f)
	switch {
	case err != nil || c == nil:
		return "", "", err
	case c.choices != nil:
		gbnf, err = choiceGrammar(c.param, c.choices)
	case c.regex != nil:
		if *c.regex == "" {
			return "", "", invalid(c.param, "%s is empty", c.param)
		}
		if gbnf, err = engine.RegexGrammar(*c.regex); err != nil {
			err = invalid(c.param, "%s: %s", c.param, refusal(err, "regex "))
		}
	case c.schema == nil:
		if gbnf, err = engine.ParseGBNF(c.grammar, v); err != nil {
			err = invalid(c.param, "%s: %s", c.param, refusal(err, "grammar: "))
		}
	default:
		gbnf, err = s.schemaGrammar(c.param, c.schema)
	}
	return c.param, gbnf, err
}

// refusal is the reason engine gives for refusing a client's input, without
// the prefix naming what it read (the field names it) and the sentinel's text.
func refusal(err error, prefix string) string {
	return strings.TrimPrefix(strings.TrimSuffix(err.Error(), ": "+engine.ErrInvalidInput.Error()), prefix)
}

// answerSchema is the schema of a tool protocol answer's "response" under the
// request's output constraint: a string without one.
func answerSchema(c *constraint) (json.RawMessage, error) {
	switch {
	case c == nil:
		return json.RawMessage(textAnswer), nil
	case c.regex != nil || c.schema == nil && c.choices == nil:
		return nil, invalid(c.param, "%s cannot be combined with tools: constrain the answer with a JSON schema or guided_choice, or leave the tools out", c.param)
	case c.choices != nil:
		if _, err := choiceGrammar(c.param, c.choices); err != nil {
			return nil, err
		}
		b, _ := json.Marshal(map[string]any{"type": "string", "enum": c.choices})
		return b, nil
	}
	return unquoteSchema(c.schema), nil
}

// unquoteSchema is the schema a string holds, when raw is one (vLLM accepts a
// schema as an object or as a string holding one), else raw.
func unquoteSchema(raw json.RawMessage) json.RawMessage {
	var text string
	if json.Unmarshal(raw, &text) == nil {
		return json.RawMessage(text)
	}
	return raw
}

// schemaGrammar converts a JSON schema, given as an object or as a string holding
// one (vLLM accepts both for guided_json), to GBNF.
func (s *Server) schemaGrammar(param string, raw json.RawMessage) (string, error) {
	raw = unquoteSchema(raw)
	var v any
	if err := json.Unmarshal(raw, &v); err != nil {
		return "", invalid(param, "%s: not a JSON schema: %v", param, err)
	}
	if _, ok := v.(map[string]any); !ok {
		if b, ok := v.(bool); !ok || !b {
			return "", invalid(param, "%s: a JSON schema is an object", param)
		}
	}
	if d := schemaDepth(raw); d > maxSchemaDepth {
		return "", invalid(param, "%s: the schema nests %d levels deep, more than %d", param, d, maxSchemaDepth)
	}
	if at := emptyChoice(v, "schema"); at != "" {
		return "", invalid(param, "%s: %s is an empty list: no value would match", param, at)
	}
	if m, ok := v.(map[string]any); ok && m["$ref"] != nil {
		var top map[string]json.RawMessage
		if json.Unmarshal(raw, &top) == nil {
			rootRefUnderAllOf(top)
			raw, _ = json.Marshal(top)
		}
	}
	return s.convertSchema(param, raw)
}

// convertSchema converts a checked schema to GBNF.
func (s *Server) convertSchema(param string, raw json.RawMessage) (string, error) {
	if s.cfg.SchemaToGrammar == nil {
		return "", invalid(param, "JSON schemas are not supported by this server")
	}
	g, err := s.schemaToGrammar(param, raw)
	if err != nil {
		return "", invalid(param, "%s: %v", param, err)
	}
	return g, nil
}

// schemaToGrammar converts a schema. A pattern a grammar cannot express
// refuses the request, except in tools' parameters, where it is left out (the
// model still sees it in the tool's description, and one MCP tool's pattern
// does not make every request of a client fail). The converter's wrapper
// refuses what no value meets or the converter would crash on
// (engine.CheckSchema) and rewrites the patterns (engine.RewritePatterns).
func (s *Server) schemaToGrammar(param string, raw json.RawMessage) (string, error) {
	if param == "tools" {
		raw = engine.DropPatterns(raw)
	}
	return s.cfg.SchemaToGrammar(raw)
}

// toolGrammar is the GBNF of tp's answers. When the converter refuses it, the
// error names the tool whose parameters it refuses alone.
func (s *Server) toolGrammar(tp *toolPlan) (string, error) {
	g, err := s.convert(tp, tp.schema())
	if err != nil {
		return "", s.refusedTool(tp, err)
	}
	return g, nil
}

// refusedTool names the tool whose parameters the converter refuses alone,
// when one does; else it returns err, the refusal of tp's whole grammar.
func (s *Server) refusedTool(tp *toolPlan, err error) error {
	if s.cfg.SchemaToGrammar == nil {
		return err
	}
	for i, f := range tp.tools {
		if tp.converting > maxToolConverting {
			return err // the whole grammar's refusal, without naming the tool
		}
		took, e := onThreadCPU(func() error { _, e := s.schemaToGrammar("tools", f.Parameters); return e })
		if tp.converting += took; e != nil {
			return invalid(fmt.Sprintf("tools[%d]", i), "tools[%d] (%s): parameters: %v", i, f.Name, e)
		}
	}
	return err
}

// maxToolConverting bounds the CPU time converting one request's tool
// schemas may take: each conversion is bounded (engine.CheckSchema), but
// the call formats that convert each tool, or each parameter, apart could
// take that for each of 512 tools.
const maxToolConverting = time.Second

// convert converts a tool schema of tp's, counting its time against
// maxToolConverting.
func (s *Server) convert(tp *toolPlan, raw json.RawMessage) (string, error) {
	if tp.converting > maxToolConverting {
		return "", invalid("tools", "tools: converting the tools' parameters to a grammar took llama.cpp more than %v: fewer tools, or simpler parameters", maxToolConverting)
	}
	var g string
	took, err := onThreadCPU(func() error {
		var err error
		g, err = s.convertSchema("tools", raw)
		return err
	})
	tp.converting += took
	return g, err
}

// maxChoices bounds guided_choice.
const maxChoices = 1024

// choiceGrammar is GBNF for exactly one of choices.
func choiceGrammar(param string, choices []string) (string, error) {
	if len(choices) == 0 || len(choices) > maxChoices {
		return "", invalid(param, "%s needs 1 to %d choices, got %d", param, maxChoices, len(choices))
	}
	var b strings.Builder
	b.WriteString("root ::=")
	for i, c := range choices {
		if c == "" {
			return "", invalid(param, "%s: choice %d is empty", param, i)
		}
		if i > 0 {
			b.WriteString(" |")
		}
		b.WriteString(" ")
		b.WriteString(engine.GBNFLiteral(c))
	}
	b.WriteString("\n")
	return b.String(), nil
}

// generates refuses a generation request for this node's model when it is an
// embedding model (requests for other models were routed by begin).
// beginGeneration starts a generation request: the model loaded, req decoded
// and admitted (begin), a generating (not embedding) node. ok is false when it
// answered already.
func (s *Server) beginGeneration(c *gin.Context, req any, model *string, priority **int) (b *Backend, forwarded, ok bool) {
	if b, ok = s.readyBackend(c); !ok {
		return nil, false, false
	}
	if forwarded, ok = s.begin(c, req, model, priority); !ok || !serves(c, b, cluster.TaskGenerate) {
		return nil, forwarded, false
	}
	return b, forwarded, true
}

func (s *Server) chat(c *gin.Context) {
	var req ChatRequest
	b, forwarded, ok := s.beginGeneration(c, &req, &req.Model, &req.Priority)
	if !ok {
		return
	}
	p, err := s.chatPlan(b, &req)
	if err != nil {
		abort(c, err)
		return
	}
	s.routeOrRun(c, b, p, forwarded)
}

// chatPlan validates a chat request into a plan with its one prompt.
func (s *Server) chatPlan(b *Backend, req *ChatRequest) (*plan, error) {
	maxTokens, param := req.MaxTokens, "max_tokens"
	if req.MaxCompletionTokens != nil {
		maxTokens, param = req.MaxCompletionTokens, "max_completion_tokens"
	}
	p, err := s.samplingPlan(b, &req.SamplingFields, param, maxTokens)
	if err != nil {
		return nil, err
	}
	p.chat = true
	if param != "max_tokens" {
		p.params = map[string]string{"max_tokens": param}
	}
	if len(req.Messages) == 0 {
		return nil, invalid("messages", "messages must not be empty")
	}
	for _, m := range req.Modalities {
		if m != "text" {
			return nil, invalid("modalities", "modalities: only \"text\" is served, not %q", m)
		}
	}
	if given(req.Audio) {
		return nil, invalid("audio", "audio output is not served: a node writes text only")
	}
	tp, err := toolsOf(&req.ToolFields, &req.SamplingFields)
	if err != nil {
		return nil, err
	}
	end, err := turnEndOf(req.AddGenerationPrompt, req.ContinueFinalMessage)
	if err != nil {
		return nil, err
	}
	text, err := chatPromptEnding(b, req.Messages, tp, req.ChatTemplateKwargs, end)
	if err != nil {
		return nil, err
	}
	if tp != nil {
		if tp.format != nil {
			p.req.Grammar, p.req.GrammarTriggers, err = s.callGrammar(tp)
			// Tags that are control tokens are kept in the output, to be read
			// (as vLLM sets skip_special_tokens false for Mistral's).
			p.req.SpecialTokens = p.req.SpecialTokens || tp.format.control
		} else {
			p.req.Grammar, err = s.toolGrammar(tp)
		}
		if err != nil {
			return nil, err
		}
		p.tools, p.grammarParam = tp, "tools"
		// Stop strings are matched in the answer's text, not in calls (nor in
		// the tool protocol's JSON around an answer).
		tp.stopAt = stopMatcher{stops: p.req.Stop, include: p.req.IncludeStop, min: p.req.MinTokens}
		p.req.Stop = nil
	}
	p.think = s.thinkingPlan(b, text, tp, &p.req)
	toks, err := s.chatTokens(b, &p, text)
	if err != nil {
		return nil, err
	}
	p.prompts = [][]engine.Token{toks}
	if req.TopLogprobs != nil {
		if *req.TopLogprobs < 0 || *req.TopLogprobs > sample.MaxTopLogprobs {
			return nil, invalid("top_logprobs", "top_logprobs must be between 0 and %d", sample.MaxTopLogprobs)
		}
		if !req.Logprobs {
			return nil, invalid("top_logprobs", "top_logprobs requires logprobs: true")
		}
		p.top = *req.TopLogprobs
	}
	p.logprobs = req.Logprobs
	return &p, nil
}

// given reports whether a raw JSON field holds something (not absent, null or []).
func given(raw json.RawMessage) bool {
	s := strings.TrimSpace(string(raw))
	return s != "" && s != "null" && s != "[]"
}

// maxGrammarCompile bounds what compiling a request's grammars, once per
// choice, may cost the scheduler's goroutine (measured on the check, which
// compiles it once: its thread's CPU time, so that a busy machine does not
// make it look dearer).
const maxGrammarCompile = 100 * time.Millisecond

// seqs is how many sequences p runs together: prompts × n.
func (p *plan) seqs() int { return max(len(p.prompts), 1) * max(p.n, 1) }

// need is what p asks of the node that runs it: the routing constraints run
// checks.
func (p *plan) need() cluster.Need {
	need := cluster.Need{Seqs: p.seqs(), MaxTokens: p.maxTokens}
	out := 1
	if p.maxTokensAsked && !p.req.IgnoreEOS {
		out = p.req.MaxTokens
	}
	for _, toks := range p.prompts {
		n := len(toks)
		switch {
		case p.truncate < 0:
			n = 0 // cut to what the context holds, wherever it runs
		case p.truncate > 0:
			n = min(n, p.truncate)
		}
		need.Length = max(need.Length, n+out)
	}
	return need
}

// routeOrRun serves the request here unless routing sends it elsewhere (by
// its first prompt's tokens).
func (s *Server) routeOrRun(c *gin.Context, b *Backend, p *plan, forwarded bool) {
	if p.req.Grammar != "" && b.CheckGrammar != nil {
		took, err := onThreadCPU(func() error { return b.CheckGrammar(p.req.Grammar) })
		if err != nil {
			abort(c, invalid(p.grammarParam, "%s: the grammar built from it does not parse: %v", p.grammarParam, err))
			return
		}
		// The scheduler compiles the grammar again for every choice as it
		// admits them, on the goroutine that runs every request's steps.
		if n := len(p.prompts) * p.n; took*time.Duration(n) > maxGrammarCompile {
			each := ""
			if n > 1 {
				each = fmt.Sprintf(", for each of %d choices", n)
			}
			abort(c, invalid(p.grammarParam, "%s: the grammar built from it takes llama.cpp %v to compile%s: more than %v in all, which would hold up every request on the node (fewer alternatives at its start, such as enum values or anyOf branches, or fewer choices)",
				p.grammarParam, took.Round(time.Millisecond), each, maxGrammarCompile))
			return
		}
	}
	if p.images != nil {
		c.Set(taskKey, cluster.TaskVision) // to a node that reads images
		// A node reading images routes by the prompt as such nodes cache it,
		// images laid out; others by the text around them, as it does a prompt
		// with web images, which only the node computing it fetches.
		if !forwarded && b.Projector != nil && !p.images.laidOut && !p.images.fetches() && s.node() != nil && !s.imageTokens(c, b, p) {
			return
		}
	}
	if !forwarded {
		// A scored prompt reads nothing from the cache: placed by load alone.
		answered, done := s.route(c, p.model, p.prompts[0], p.prompts[1:], p.n, p.need(), p.req.Priority, p.req.PromptLogprobs)
		defer done()
		if answered {
			return
		}
	}
	s.run(c, b, p)
}

func (s *Server) completions(c *gin.Context) {
	var req CompletionRequest
	b, forwarded, ok := s.beginGeneration(c, &req, &req.Model, &req.Priority)
	if !ok {
		return
	}
	p, err := s.completionPlan(b, &req)
	if err != nil {
		abort(c, err)
		return
	}
	s.routeOrRun(c, b, p, forwarded)
}

// completionPlan validates a completions request into a plan with its prompts.
func (s *Server) completionPlan(b *Backend, req *CompletionRequest) (*plan, error) {
	warm := req.MaxTokens != nil && *req.MaxTokens == 0
	if warm {
		if !req.Echo {
			return nil, invalid("max_tokens", "max_tokens must be at least 1, got 0 (0 is only for echo: the prompt alone)")
		}
		one := 1
		req.MaxTokens = &one
	}
	p, err := s.samplingPlan(b, &req.SamplingFields, "max_tokens", req.MaxTokens)
	if err != nil {
		return nil, err
	}
	p.warm = warm
	if bo := req.BestOf; bo != nil && *bo != 1 && *bo != p.n {
		if *bo < p.n {
			return nil, invalid("best_of", "best_of must be at least n (%d), got %d", p.n, *bo)
		}
		return nil, invalid("best_of", "best_of %d is not served (as vLLM's V1 engine serves none): ask for n=%d with logprobs=0 and keep the choices whose logprobs sum highest", *bo, *bo)
	}
	if req.MaxTokens == nil {
		p.req.MaxTokens = CompletionsMaxTokens
		if p.req.MinTokens > p.req.MaxTokens {
			return nil, invalid("min_tokens", "min_tokens %d exceeds max_tokens, %d by default on /v1/completions", p.req.MinTokens, p.req.MaxTokens)
		}
	}
	if req.Prompt == nil || (len(req.Prompt.Texts) == 0 && len(req.Prompt.Tokens) == 0) {
		return nil, invalid("prompt", "prompt is required")
	}
	// A suffix asks for the text between the prompt and it: a code model's
	// fill-in-the-middle, laid out as /infill lays out a prefix and a suffix.
	// An empty one is no suffix.
	fill := req.Suffix != nil && *req.Suffix != ""
	switch {
	case fill && !b.Vocab.FIM().Infill():
		return nil, invalid("suffix", "suffix needs a code model with fill-in-the-middle tokens (FIM_PRE, FIM_SUF, FIM_MID); this model has none")
	case fill && len(req.Prompt.Tokens) > 0:
		return nil, invalid("suffix", "suffix needs the prompt as text: token ids are laid out as given")
	case fill && req.Echo:
		return nil, invalid("echo", "echo is not supported with suffix")
	}
	if req.Logprobs != nil {
		if *req.Logprobs < 0 || *req.Logprobs > sample.MaxTopLogprobs {
			return nil, invalid("logprobs", "logprobs must be between 0 and %d", sample.MaxTopLogprobs)
		}
		p.logprobs, p.top, p.completes = true, *req.Logprobs, true
	}
	if n := len(req.Prompt.Texts) + len(req.Prompt.Tokens); n*p.n > scheduler.MaxChoices*4 {
		return nil, invalid("prompt", "%d prompts × n=%d choices is too many for one request", n, p.n)
	}
	for i, t := range req.Prompt.Texts {
		toks, err := b.Vocab.Tokenize(t, true, true)
		if fill {
			var in *infill
			if in, err = newInfill(b.Vocab, nil, t, *req.Suffix, "", false); err == nil {
				toks = in.tokens()
			}
		}
		if err != nil {
			return nil, err
		}
		if len(toks) == 0 {
			return nil, invalid("prompt", "prompt %d is empty", i)
		}
		p.prompts = append(p.prompts, toks)
		p.echo = append(p.echo, t)
	}
	for i, ids := range req.Prompt.Tokens {
		toks, err := tokenIDs(ids, b.Vocab.Size(), "prompt", i)
		if err != nil {
			return nil, err
		}
		text, err := b.Vocab.Detokenize(toks, false, false)
		if err != nil {
			return nil, err
		}
		p.prompts = append(p.prompts, toks)
		p.echo = append(p.echo, text)
	}
	if !req.Echo {
		p.echo = nil
	} else if p.logprobs {
		// OpenAI's echo with logprobs scores the prompt's tokens too: evaluation
		// harnesses (lm-evaluation-harness's loglikelihood) read them.
		p.echoScores, p.req.PromptLogprobs = true, true
		p.req.PromptTopLogprobs = max(p.req.PromptTopLogprobs, p.top)
	}
	return &p, nil
}

// begin decodes a request into req (whose model and priority, if any, are read from
// model and priority once decoded), checks a forwarded request's credential, and
// forwards a request for a model served only elsewhere. ok is false when the
// request was answered.
func (s *Server) begin(c *gin.Context, req any, model *string, priority **int) (forwarded, ok bool) {
	if err := decodeBody(c, req); err != nil {
		abort(c, err)
		return false, false
	}
	if forwarded, ok = s.checkHop(c); !ok {
		return forwarded, false
	}
	var prio *int
	if priority != nil {
		prio = *priority
	}
	p := priorityOf(prio)
	if p != 0 && !s.cfg.PriorityScheduling {
		abort(c, invalid("priority", "priority %d needs priority scheduling, which this server does not use (start it with --scheduling-policy priority)", p))
		return forwarded, false
	}
	need := cluster.Need{}
	if r, ok := req.(interface{ routeNeed() cluster.Need }); ok {
		need = r.routeNeed()
	}
	return forwarded, s.routeElsewhere(c, forwarded, *model, p, need)
}

// routeNeed is what a request asks of the node that runs it as far as its body
// says, before its prompt is tokenized (at a node that does not serve its
// model, which routes it by this): its output and choices.
func (f *SamplingFields) routeNeed() cluster.Need {
	return outputNeed(f.MaxTokens, f.N, f.IgnoreEOS)
}

func (r *ChatRequest) routeNeed() cluster.Need {
	return outputNeed(cmp.Or(r.MaxCompletionTokens, r.MaxTokens), r.N, r.IgnoreEOS)
}

func (r *ResponsesRequest) routeNeed() cluster.Need {
	return outputNeed(r.MaxOutputTokens, nil, false)
}

func (r *MessagesRequest) routeNeed() cluster.Need {
	return outputNeed(r.MaxTokens, nil, false)
}

// outputNeed is the Need of maxTokens output tokens (nil: none asked) in n
// choices, each with a prompt of at least one token.
func outputNeed(maxTokens, n *int, ignoreEOS bool) cluster.Need {
	need := cluster.Need{Seqs: 1}
	if n != nil && *n > 1 {
		need.Seqs = *n
	}
	if maxTokens != nil && *maxTokens > 0 {
		need.MaxTokens = *maxTokens
		if !ignoreEOS {
			need.Length = *maxTokens + 1
		}
	}
	return need
}

// routeElsewhere sends a request for a model this node does not serve to a node
// that does (and whose limits need fits: the prompt's length is not known
// here), and answers false when it did (or refused it). A forwarded request
// has made its one hop: if this node does not serve its model (the router's view
// was stale), it gets 404 rather than another model's answer.
func (s *Server) routeElsewhere(c *gin.Context, forwarded bool, model string, priority int, need cluster.Need) bool {
	if model == "" && !forwarded && !s.servesTask(c) {
		// No model named, at a node that does not compute the request's task:
		// the model a member serves for it (a reranker, for a rerank request).
		model = s.taskModel(c.GetString(taskKey))
	}
	_, here := s.adapterOf(model)
	if s.node() == nil || here && s.servesTask(c) {
		return true
	}
	switch {
	case forwarded && here:
		return true // for another task than this node's: its own answer says which
	case forwarded:
		abort(c, &Error{Status: http.StatusNotFound, Type: "invalid_request_error", Code: "model_not_found", Param: "model",
			Message: fmt.Sprintf("the model %q was forwarded to this node, which serves %q", model, s.cfg.ModelName)})
		return false
	}
	// Served here for another task (one file served both to generate and to
	// embed): a node of the request's task answers, else this node says which
	// task it serves (no tokens, but not nil: route falls back to here).
	var tokens []engine.Token
	if here {
		tokens = []engine.Token{}
	}
	body, _ := c.Get(bodyKey)
	if raw, _ := body.([]byte); c.GetString(taskKey) == "" && mayCarryImages(raw) && s.visionServes(model) {
		// Pictures, maybe (not yet read): to a node that reads them, if one
		// serves the model; the one it is sent to says if there were none.
		c.Set(taskKey, cluster.TaskVision)
	}
	answered, done := s.route(c, model, tokens, nil, 1, need, priority, false)
	done()
	return !answered
}

// checkHop verifies a forwarded request's credential; ok is false when it was refused.
func (s *Server) checkHop(c *gin.Context) (forwarded, ok bool) {
	body, _ := c.Get(bodyKey)
	raw, _ := body.([]byte)
	forwarded, err := s.forwardedRequest(c, raw)
	if err != nil {
		abort(c, err)
		return forwarded, false
	}
	return forwarded, true
}

// elsewhere reports whether model is served by another node, not this one.
func priorityOf(p *int) int {
	if p == nil {
		return 0
	}
	return *p
}

// submitted is one prompt's stream and where its choices go.
type submitted struct {
	stream *scheduler.Stream
	base   int // choice index of its first choice
	start  time.Time
	prompt int // its prompt's tokens
}

// keepLast is toks cut to its last k tokens (truncate_prompt_tokens). The BOS
// a text prompt starts with stays, as a tokenizer truncating from the left
// keeps its special tokens.
func keepLast(b *Backend, toks []engine.Token, k int) []engine.Token {
	switch {
	case len(toks) <= k:
		return toks
	case toks[0] == b.Vocab.BOS() && b.Vocab.AddBOS() && k > 1:
		return append([]engine.Token{toks[0]}, toks[len(toks)-k+1:]...)
	}
	return toks[len(toks)-k:]
}

// which names prompt i of n in an error: "messages", or "prompt 2" among several.
func which(where string, i, n int) string {
	if n > 1 {
		return fmt.Sprintf("%s %d", where, i)
	}
	return where
}

// run submits every prompt and answers, streamed or whole.
func (s *Server) run(c *gin.Context, b *Backend, p *plan) {
	ctx := c.Request.Context()
	maxCtx := b.Generator.MaxContext()
	if most := s.cfg.MaxTokensCap; most > 0 && p.maxTokens > most {
		abort(c, invalid(p.maxTokensParam, "%s %d exceeds this server's cap of %d", p.maxTokensParam, p.maxTokens, most).renamed(p.params))
		return
	}
	// Its sequences wait together: more than the queue holds would be refused
	// with 429 however long the client waited to retry.
	if seqs, most := p.seqs(), b.Generator.Load().MaxWaiting; most > 0 && seqs > most {
		param := "n"
		if len(p.prompts) > 1 {
			param = "prompt"
		}
		abort(c, invalid(param, "the request runs %d sequences (prompts × n), more than this node's waiting queue holds (--max-waiting %d)", seqs, most))
		return
	}
	// OpenAI's wording (vLLM keeps it too): clients such as LiteLLM recognise a
	// context overflow by it.
	where, param := "messages", p.param("messages")
	if !p.chat {
		where, param = "prompt", "prompt"
	}
	tooLong := func(i, n int) {
		s.metrics.rejected(scheduler.ErrPromptTooLong)
		msg := fmt.Sprintf("This model's maximum context length is %d tokens. However, your %s resulted in %d tokens, which leaves no room for the completion. Please reduce the length of the %s.", maxCtx, which(where, i, len(p.prompts)), n, where)
		if p.anthropic {
			msg = fmt.Sprintf("prompt is too long: %d tokens > %d maximum", n, maxCtx-1) // Anthropic's wording, which its clients recognise
		}
		abort(c, &Error{Status: http.StatusBadRequest, Type: "invalid_request_error", Code: "context_length_exceeded", Param: param, Message: msg})
	}
	if p.truncate != 0 && (p.images != nil || len(p.echo) > 0) {
		// An image cut in two, or an echo of what was not computed.
		abort(c, invalid("truncate_prompt_tokens", "truncate_prompt_tokens is not served with images or echo"))
		return
	}
	if p.images != nil {
		var long *engine.PromptTooLongError
		if err := s.imagePrompt(ctx, b, p, maxCtx); errors.As(err, &long) {
			tooLong(0, long.Tokens)
			return
		} else if err != nil {
			if errors.Is(err, scheduler.ErrQueueFull) {
				s.metrics.rejected(err)
			}
			abort(c, err)
			return
		}
	}
	for i, toks := range p.prompts {
		if k := p.truncate; k != 0 {
			if k < 0 {
				k = maxCtx - 1
			}
			toks = keepLast(b, toks, k)
			p.prompts[i] = toks
		}
		if len(toks) >= maxCtx {
			tooLong(i, len(toks))
			return
		}
		if p.maxTokensAsked && p.req.MaxTokens > maxCtx-len(toks) && !p.req.IgnoreEOS {
			// Like vLLM: the request can never be served in full.
			s.metrics.rejected(scheduler.ErrPromptTooLong)
			abort(c, &Error{Status: http.StatusBadRequest, Type: "invalid_request_error", Code: "context_length_exceeded", Param: p.param("max_tokens"),
				Message: fmt.Sprintf("This model's maximum context length is %d tokens. However, you requested %d tokens (%d in the %s, %d for the completion). Please reduce the length of the %s or the completion.", maxCtx, uint64(len(toks))+uint64(p.req.MaxTokens), len(toks), which(where, i, len(p.prompts)), p.req.MaxTokens, where)})
			return
		}
	}
	statsOf(ctx).serves(p.model)
	var subs []submitted
	ctx, cancel := context.WithCancel(ctx)
	defer cancel() // a failed submit or a gone client cancels everything submitted
	for i, toks := range p.prompts {
		r := p.req
		r.Prompt = toks // MaxTokens 0: the scheduler's default; the context caps any
		r.Sampling.Logprobs = p.logprobs
		r.Sampling.TopLogprobs = p.top
		st, err := b.Generator.Submit(ctx, &r)
		if err != nil {
			s.metrics.rejected(err)
			abort(c, err)
			return
		}
		subs = append(subs, submitted{stream: st, base: i * p.n, start: time.Now(), prompt: len(toks)})
	}
	switch {
	case p.infill != nil:
		s.infillAnswer(c, b, p, subs)
	case p.ollama != nil:
		s.ollamaAnswer(c, b, p, subs[0])
	case p.anthropic && p.stream:
		s.messageStream(c, b, p, subs)
	case p.anthropic:
		s.messageWhole(c, b, p, subs)
	case p.responses != nil && p.stream:
		s.responseStream(c, b, p, subs)
	case p.responses != nil:
		s.responseWhole(c, b, p, subs)
	case p.stream:
		s.streamResponse(c, b, p, subs)
	default:
		s.wholeResponse(c, b, p, subs)
	}
	if all := len(p.prompts) * p.n; p.finished < all {
		if st := statsOf(c.Request.Context()); st != nil {
			st.incomplete.Store(true)
		}
		if c.Request.Context().Err() != nil {
			// The client left: the choices it did not see end are aborted (the
			// scheduler ends them, but nobody reads their finish).
			s.metrics.aborted(all - p.finished)
		}
	}
}

// randomID is a new id with prefix, spelled as OpenAI, Anthropic and vLLM spell
// theirs: chatcmpl-..., cmpl-..., rerank-..., score-...; call_..., msg_..., resp_... .
func randomID(prefix string) string {
	var buf [12]byte
	_, _ = crand.Read(buf[:])
	sep := "_"
	switch prefix {
	case "chatcmpl", "cmpl", "rerank", "score":
		sep = "-"
	}
	return fmt.Sprintf("%s%s%x", prefix, sep, buf)
}

// choiceState accumulates one choice's output.
type choiceState struct {
	text      strings.Builder // under tools, the answer's text (output)
	reasoning strings.Builder // a reasoning model's thoughts
	finish    string
	stop      any // stop_reason
	thoughts  int // tokens whose text went to reasoning
	logprobs  []TokenLogprob
	prompt    []engine.TokenScore // its prompt's scores, when asked for
	output    *choiceOutput       // nil: the output is the text
	started   bool                // output was made
}

// countThought counts ev's token among the thoughts when it wrote some (or,
// a part of a character, wrote nothing yet while the thoughts go on).
func (ch *choiceState) countThought(ev scheduler.Event, reasoning string) {
	if ev.Kind == scheduler.EventToken && (reasoning != "" || ch.output != nil && ch.output.thinking()) {
		ch.thoughts++
	}
}

func finishString(f scheduler.FinishReason) string {
	if f == scheduler.FinishLength {
		return "length"
	}
	return "stop"
}

// stopReason is vLLM's stop_reason of a finish event: the stop string or the
// stop token id that ended the choice, nil when neither did.
func stopReason(ev scheduler.Event) any {
	switch {
	case ev.StopString != "":
		return ev.StopString
	case ev.ByStopToken:
		return int(ev.Token)
	}
	return nil
}

// outputStop is the stop_reason of a choice whose output o followed, given
// the generator's and the finish_reason.
func outputStop(o *choiceOutput, generated any, finish string) any {
	switch {
	case finish != "stop":
		return nil
	case o != nil && o.stopString() != "":
		return o.stopString()
	}
	return generated
}

func (s *Server) wholeResponse(c *gin.Context, b *Backend, p *plan, subs []submitted) {
	choices, usage, ok := s.collect(c, b, p, subs)
	if !ok {
		return
	}
	created := s.now().Unix()
	if p.chat {
		resp := ChatResponse{ID: s.newID("chatcmpl"), Object: "chat.completion", Created: created, Model: p.model,
			SystemFingerprint: fingerprint, Usage: usage}
		for i := range choices {
			a := s.answer(&choices[i])
			cc := ChatChoice{Index: i, Message: ChatMessageOut{Role: "assistant", Content: &a.text, ToolCalls: a.calls},
				FinishReason: a.finish, StopReason: a.stop}
			if len(a.calls) > 0 && strings.TrimSpace(a.text) == "" {
				cc.Message.Content = nil // text the model wrote before its calls is kept, as vLLM does
			}
			if a.reasoning != "" {
				cc.Message.ReasoningContent = &a.reasoning
			}
			if p.logprobs {
				cc.Logprobs = &ChatLogprobs{Content: nonNil(choices[i].logprobs)}
			}
			resp.Choices = append(resp.Choices, cc)
		}
		if p.promptScores {
			resp.PromptLogprobs = promptLogprobs(b.Vocab, p.prompts[0], choices[0].prompt, p.promptTop)
		}
		c.JSON(http.StatusOK, resp)
		return
	}
	resp := CompletionResponse{ID: s.newID("cmpl"), Object: "text_completion", Created: created, Model: p.model,
		SystemFingerprint: fingerprint, Usage: &usage}
	for i := range choices {
		f := choices[i].finish
		cc := CompletionChoice{Index: i, Text: choices[i].text.String(), FinishReason: &f, StopReason: choices[i].stop}
		pi := i / p.n
		if p.warm { // the prompt alone
			f = "length"
			cc.Text, cc.StopReason, choices[i].logprobs = p.echo[pi], nil, nil
		}
		if p.logprobs {
			cc.Logprobs = newLegacyLogprobs()
			offset := 0
			if p.echoScores {
				offset = cc.Logprobs.addPrompt(p, b.Vocab, p.prompts[pi], choices[i].prompt, p.top)
			}
			cc.Logprobs.add(choices[i].logprobs, offset)
		}
		if p.promptScores {
			cc.PromptLogprobs = promptLogprobs(b.Vocab, p.prompts[pi], choices[i].prompt, p.promptTop)
		}
		resp.Choices = append(resp.Choices, cc)
	}
	c.JSON(http.StatusOK, resp)
}

// collect reads every choice of p to its end; ok is false when it answered
// with an error instead.
func (s *Server) collect(c *gin.Context, b *Backend, p *plan, subs []submitted) (choices []choiceState, usage Usage, ok bool) {
	ctx := c.Request.Context()
	choices = make([]choiceState, len(p.prompts)*p.n)
	for pi, sub := range subs {
		if pi < len(p.echo) {
			for j := range p.n {
				choices[sub.base+j].text.WriteString(p.echo[pi])
			}
		}
		u, err := s.drain(ctx, b, p, sub, func(ev scheduler.Event) {
			if ev.Kind == scheduler.EventPromptLogprobs {
				for j := range p.n {
					choices[sub.base+j].prompt = ev.Prompt
				}
				return
			}
			ch := &choices[sub.base+ev.Index]
			if !ch.started {
				ch.output, ch.started = p.newOutput(), true
			}
			text := ev.Text
			if ch.output != nil {
				var reasoning string
				reasoning, text = ch.output.follow(sub.stream, ev)
				ch.reasoning.WriteString(reasoning)
				ch.countThought(ev, reasoning)
			}
			switch ev.Kind {
			case scheduler.EventToken:
				ch.text.WriteString(text)
				if p.logprobs && (ch.output == nil || !ch.output.cutByStop()) {
					ch.logprobs = append(ch.logprobs, p.tokenLogprob(b.Vocab, ev))
				}
			case scheduler.EventFinish:
				ch.text.WriteString(text)
				ch.finish, ch.stop = finishString(ev.Finish), stopReason(ev)
			}
		})
		if err != nil {
			abort(c, err)
			return nil, usage, false
		}
		addUsage(&usage, u)
	}
	return choices, usage, true
}

// chatAnswer is a chat choice's output once whole.
type chatAnswer struct {
	text, reasoning string
	reasoningTokens int
	calls           []ToolCall
	finish          string
	stop            any // stop_reason
}

// answer is ch's output once whole: under tools, the calls are read from it.
func (s *Server) answer(ch *choiceState) chatAnswer {
	a := chatAnswer{text: ch.text.String(), reasoning: ch.reasoning.String(), reasoningTokens: ch.thoughts, finish: ch.finish, stop: ch.stop}
	if o := ch.output; o != nil {
		var rest string
		rest, a.calls, a.finish = o.end(s.newCallID, a.finish)
		a.text += rest
		a.stop = outputStop(o, a.stop, a.finish)
	}
	return a
}

// newCallID is a new tool call's id (a format may derive its own from it).
func (s *Server) newCallID() string { return s.newID("call") }

// fingerprint identifies the serving stack in responses.
const fingerprint = "shoal"

func nonNil[T any](s []T) []T {
	if s == nil {
		return []T{}
	}
	return s
}

func addUsage(u *Usage, x scheduler.Usage) {
	u.PromptTokens += x.PromptTokens
	u.CompletionTokens += x.CompletionTokens
	u.TotalTokens = u.PromptTokens + u.CompletionTokens
	u.PromptTokensDetails.CachedTokens += x.CachedTokens
}

// tokenTimes are when a choice's first and last tokens came (the scheduler's
// timestamps), for the timings llama-server's and Ollama's answers report.
type tokenTimes struct{ first, last time.Time }

// see notes ev's time when it is a token.
func (t *tokenTimes) see(ev scheduler.Event) {
	if ev.Kind != scheduler.EventToken {
		return
	}
	if t.first.IsZero() {
		t.first = ev.At
	}
	t.last = ev.At
}

// prompt is how long the prompt took: from sub's submission to the first
// token, less the wait for a place in a batch (0 before any token).
func (t *tokenTimes) prompt(sub submitted, u scheduler.Usage) time.Duration {
	if t.first.IsZero() {
		return 0
	}
	return max(0, t.first.Sub(sub.start)-u.QueueTime)
}

// generating is the time from the first token to the last.
func (t *tokenTimes) generating() time.Duration { return t.last.Sub(t.first) }

// drain reads a stream to its end, calling fn for token and finish events and
// recording metrics. It returns the usage or the stream's error.
func (s *Server) drain(ctx context.Context, b *Backend, p *plan, sub submitted, fn func(scheduler.Event)) (scheduler.Usage, error) {
	// Per choice, from the scheduler's timestamps: choices of one prompt are read in
	// turn, and prompts one after another.
	choices := map[int]*choiceStats{}
	choice := func(i int) *choiceStats {
		c := choices[i]
		if c == nil {
			c = &choiceStats{}
			choices[i] = c
		}
		return c
	}
	st := statsOf(ctx) // the request log's, looked up once rather than per token
	// cut ends a request that will not finish (its client gone, the server
	// draining): its log line counts its prompt (computed or not: a long prompt
	// left during prefill is what an operator looks for) and the tokens it was sent.
	cut := func(err error) (scheduler.Usage, error) {
		seen := scheduler.Usage{PromptTokens: sub.prompt}
		seen.CachedTokens, seen.QueueTime = sub.stream.Started()
		for _, c := range choices {
			seen.CompletionTokens += c.tokens
		}
		st.count(seen)
		return scheduler.Usage{}, err
	}
	for {
		ev, ok := sub.stream.Next(ctx)
		if !ok {
			if ctx.Err() != nil {
				return cut(ctx.Err())
			}
			return cut(errors.New("stream ended without a result"))
		}
		switch ev.Kind {
		case scheduler.EventToken:
			st.token(ev.At)
			c := choice(ev.Index)
			if c.tokens == 0 {
				s.metrics.ttft.Observe(ev.At.Sub(sub.start).Seconds())
			}
			if gap, newStep := c.token(ev); newStep { // one gap per step, as vLLM's
				s.metrics.itl.Observe(gap.Seconds())
				s.metrics.tpot.Observe(gap.Seconds())
			}
			fn(ev)
		case scheduler.EventFinish:
			s.metrics.finished(ev.Finish)
			// Per choice, as vLLM observes the children of a request with n > 1.
			_, queued := sub.stream.Started()
			s.metrics.e2e.Observe(ev.At.Sub(sub.start).Seconds())
			s.metrics.queue.Observe(queued.Seconds())
			choice(ev.Index).ended = true
			p.finished++
			fn(ev)
		case scheduler.EventPromptLogprobs:
			if p.promptScores || p.echoScores {
				fn(ev)
			}
		case scheduler.EventDone:
			s.metrics.requestEnded(sub.start, ev.Usage, max(p.n, 1), choices, !p.warm)
			if p.warm {
				ev.Usage.CompletionTokens = 0 // the token drawn is not the answer's
			}
			st.count(ev.Usage)
			return ev.Usage, nil
		case scheduler.EventError:
			return cut(ev.Err)
		}
	}
}

func (p *plan) tokenLogprob(v engine.Vocab, ev scheduler.Event) TokenLogprob {
	tl := TokenLogprob{Token: p.tokenName(v, ev.Token), Logprob: ev.Logprob, Bytes: pieceBytes(v, ev.Token), TopLogprobs: []TopLogprob{}}
	for _, t := range ev.Top {
		tl.TopLogprobs = append(tl.TopLogprobs, TopLogprob{Token: p.tokenName(v, t.Token), Logprob: t.Logprob, Bytes: pieceBytes(v, t.Token)})
	}
	return tl
}

// tokenName is how p's logprobs name token t: its text, or "token_id:ID"
// (vLLM's return_tokens_as_token_ids).
func (p *plan) tokenName(v engine.Vocab, t engine.Token) string {
	if p.tokenIDs {
		return "token_id:" + strconv.Itoa(int(t))
	}
	return pieceString(v, t)
}

func pieceBytes(v engine.Vocab, t engine.Token) []int {
	p, _ := v.Piece(t, true)
	out := make([]int, len(p))
	for i, x := range p {
		out[i] = int(x)
	}
	return out
}

func pieceString(v engine.Vocab, t engine.Token) string {
	p, _ := v.Piece(t, true)
	return strings.ToValidUTF8(string(p), "\uFFFD")
}

func newLegacyLogprobs() *CompletionLogprobs {
	return &CompletionLogprobs{Tokens: []string{}, TokenLogprobs: []*float32{}, TopLogprobs: []RankedLogprobs{}, TextOffset: []int{}}
}

// add appends chat-style logprobs in the completions format; offset is where
// the first token's text starts in the choice's text, in characters (as
// OpenAI's and vLLM's text_offset count). A token's top_logprobs hold its
// alternatives and itself, as OpenAI's and vLLM's do.
func (out *CompletionLogprobs) add(ls []TokenLogprob, offset int) {
	for _, l := range ls {
		top := append(make(RankedLogprobs, 0, len(l.TopLogprobs)+1), NamedLogprob{l.Token, l.Logprob})
		for _, t := range l.TopLogprobs {
			top = top.with(t.Token, t.Logprob)
		}
		out.Tokens = append(out.Tokens, l.Token)
		out.TokenLogprobs = append(out.TokenLogprobs, &l.Logprob)
		out.TopLogprobs = append(out.TopLogprobs, top)
		out.TextOffset = append(out.TextOffset, offset)
		offset += utf8.RuneCountInString(l.Token)
	}
}

// addPrompt appends an echoed prompt's tokens with their scores (scores[i] is
// prompt[i+1]'s; the first token has none) and up to n alternatives each, and
// returns the text_offset after them, where the generated tokens' go on: the
// offsets count the tokens' names, as vLLM's do, so that they never go back
// (a BOS named "<s>" is not in the echoed text).
func (out *CompletionLogprobs) addPrompt(p *plan, v engine.Vocab, prompt []engine.Token, scores []engine.TokenScore, n int) int {
	offset := 0
	for i, t := range prompt {
		tok := p.tokenName(v, t)
		out.Tokens = append(out.Tokens, tok)
		out.TextOffset = append(out.TextOffset, offset)
		offset += utf8.RuneCountInString(tok)
		if i == 0 || i > len(scores) {
			// null as OpenAI and vLLM write it; {} where they write null, which
			// typed clients (OpenAI's Go SDK) cannot read in a list of maps.
			out.TokenLogprobs, out.TopLogprobs = append(out.TokenLogprobs, nil), append(out.TopLogprobs, RankedLogprobs{})
			continue
		}
		sc := scores[i-1]
		lp := finite(sc.Logprob)
		top := append(make(RankedLogprobs, 0, n+1), NamedLogprob{tok, lp})
		for _, a := range sc.Top[:min(n, len(sc.Top))] {
			top = top.with(p.tokenName(v, a.Token), finite(a.Logprob))
		}
		out.TokenLogprobs, out.TopLogprobs = append(out.TokenLogprobs, &lp), append(out.TopLogprobs, top)
	}
	return offset
}

// promptLogprobs is vLLM's prompt_logprobs of a prompt: null for its first
// token, then each token's score and its top n alternatives by token id.
func promptLogprobs(v engine.Vocab, prompt []engine.Token, scores []engine.TokenScore, n int) []map[string]PromptLogprob {
	out := make([]map[string]PromptLogprob, len(prompt))
	for i, sc := range scores[:min(len(scores), max(len(prompt)-1, 0))] {
		m := map[string]PromptLogprob{}
		for r, a := range sc.Top[:min(n, len(sc.Top))] {
			m[strconv.Itoa(int(a.Token))] = PromptLogprob{Logprob: finite(a.Logprob), Rank: r + 1, DecodedToken: pieceString(v, a.Token)}
		}
		m[strconv.Itoa(int(sc.Token))] = PromptLogprob{Logprob: finite(sc.Logprob), Rank: sc.Rank, DecodedToken: pieceString(v, sc.Token)}
		out[i+1] = m
	}
	return out
}

// finite is a logprob JSON can carry: -Inf (a token the model rules out) as
// -9999, as vLLM and OpenAI write it.
func finite(lp float32) float32 {
	return max(lp, -9999)
}

// tokenIDs validates the token ids of input i of a request (param names the field).
func tokenIDs(ids []int64, vocab int, param string, i int) ([]engine.Token, error) {
	if len(ids) == 0 {
		return nil, invalid(param, "%s %d is empty", param, i)
	}
	toks := make([]engine.Token, len(ids))
	for j, id := range ids {
		if id < 0 || id >= int64(vocab) {
			return nil, invalid(param, "%s %d token %d: id %d is outside the vocabulary (0..%d)", param, i, j, id, vocab-1)
		}
		toks[j] = engine.Token(id)
	}
	return toks, nil
}
