package api

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"maps"
	"math"
	"reflect"
	"slices"
	"strconv"
	"strings"

	"github.com/shoal-ai/shoal/engine"
)

// OpenAI wire types. Field names and shapes follow the OpenAI API reference;
// extensions (top_k, min_p, repetition_penalty, priority, ignore_eos) are named as
// vLLM names them.

// StringOrList is OpenAI's `stop`: a string or a list of strings.
type StringOrList []string

func (s *StringOrList) UnmarshalJSON(b []byte) error {
	b = bytes.TrimSpace(b)
	if bytes.Equal(b, []byte("null")) {
		*s = nil
		return nil
	}
	if len(b) > 0 && b[0] == '"' {
		var one string
		if err := json.Unmarshal(b, &one); err != nil {
			return err
		}
		*s = []string{one}
		return nil
	}
	var many []string
	if err := json.Unmarshal(b, &many); err != nil {
		return &json.UnmarshalTypeError{Value: jsonKind(b), Type: reflect.TypeFor[StringOrList]()} // named in decodeBody
	}
	*s = many
	return nil
}

// Prompt is a completion prompt: a string, a list of strings, a list of token ids, or
// a list of lists of token ids. Exactly one of Texts and Tokens is set.
type Prompt struct {
	Texts  []string
	Tokens [][]int64
}

func (p *Prompt) UnmarshalJSON(b []byte) error {
	b = bytes.TrimSpace(b)
	var s string
	if err := json.Unmarshal(b, &s); err == nil && !bytes.Equal(b, []byte("null")) {
		p.Texts = []string{s}
		return nil
	}
	var ss []*string // nil: a null, which would read as ""
	if err := json.Unmarshal(b, &ss); err == nil {
		p.Texts = make([]string, len(ss))
		for i, s := range ss {
			if s == nil {
				return nullElement[string]()
			}
			p.Texts[i] = *s
		}
		return nil
	}
	var ts TokenIDs[int64]
	err := json.Unmarshal(b, &ts)
	if err == nil {
		p.Tokens = [][]int64{ts}
		return nil
	}
	var tss []TokenIDs[int64]
	if err2 := json.Unmarshal(b, &tss); err2 == nil {
		p.Tokens = make([][]int64, len(tss))
		for i, ts := range tss {
			if ts == nil {
				return nullElement[int64]()
			}
			p.Tokens[i] = ts
		}
		return nil
	} else if isNull(err) || isNull(err2) {
		return nullElement[int64]()
	}
	return &json.UnmarshalTypeError{Value: jsonKind(b), Type: reflect.TypeFor[Prompt]()} // named in decodeBody
}

// nullElement refuses a null in a list of T (encoding/json would read it as
// T's zero: "", or token 0); decodeBody names the field.
func nullElement[T any]() error {
	return &json.UnmarshalTypeError{Value: "null", Type: reflect.TypeFor[T]()}
}

// isNull reports whether err is nullElement's.
func isNull(err error) bool {
	var te *json.UnmarshalTypeError
	return errors.As(err, &te) && te.Value == "null"
}

// TokenIDs is a list of token ids, none of them null.
type TokenIDs[T int | int64] []T

func (t *TokenIDs[T]) UnmarshalJSON(b []byte) error {
	var ids []T
	if err := json.Unmarshal(b, &ids); err != nil {
		return err
	}
	// Numbers only were read: any "null" is one.
	if ids != nil && bytes.Contains(b, []byte("null")) {
		return nullElement[T]()
	}
	*t = ids
	return nil
}

// fieldError is a decoder's refusal of a field's value; decodeBody answers it
// as an invalid request on param.
type fieldError struct {
	param string
	err   error
}

func (e *fieldError) Error() string { return e.err.Error() }

// jsonKind names the kind of JSON value b is, as encoding/json's errors do.
func jsonKind(b []byte) string {
	switch {
	case len(b) == 0:
		return "nothing"
	case b[0] == '{':
		return "object"
	case b[0] == '[':
		return "array"
	case b[0] == '"':
		return "string"
	case b[0] == 't' || b[0] == 'f':
		return "bool"
	}
	return "number"
}

// Content is a chat message's content: a string or an array of parts: text,
// and images (image_url, as a data: URL), each of which becomes its marker
// in the text (imageMarker) where it stands.
type Content string

func (c *Content) UnmarshalJSON(b []byte) error {
	b = bytes.TrimSpace(b)
	if bytes.Equal(b, []byte("null")) {
		*c = ""
		return nil
	}
	var s string
	if err := json.Unmarshal(b, &s); err == nil {
		*c = Content(s)
		return nil
	}
	var parts []struct {
		Type     string          `json:"type"`
		Text     *string         `json:"text"`
		Refusal  *string         `json:"refusal"` // an assistant's part, text as vLLM reads it
		ImageURL json.RawMessage `json:"image_url"`
	}
	if err := json.Unmarshal(b, &parts); err != nil {
		// A type error names the field (messages.content) in decodeBody.
		return &json.UnmarshalTypeError{Value: jsonKind(b), Type: reflect.TypeFor[Content]()}
	}
	var buf bytes.Buffer
	for i, p := range parts {
		if i > 0 {
			buf.WriteByte('\n') // as vLLM joins text parts
		}
		switch {
		case (p.Type == "text" || p.Type == "input_text") && p.Text != nil: // input_text: vLLM reads the Responses API's spelling too
			buf.WriteString(*p.Text)
		case p.Type == "refusal" && p.Refusal != nil:
			buf.WriteString(*p.Refusal)
		case p.Type == "image_url":
			m, err := partImage(p.ImageURL)
			if err != nil {
				return &fieldError{"messages", fmt.Errorf("messages: content part %d: %w", i, err)}
			}
			buf.WriteString(m)
		default:
			return &fieldError{"messages", fmt.Errorf("messages: content part %d: parts of type \"text\" with a text field, \"refusal\" with a refusal field, or \"image_url\" are read, got type %q", i, p.Type)}
		}
	}
	*c = Content(buf.String())
	return nil
}

// partImage reads an image_url part's image into its marker: {"url": ...},
// or the URL as a string.
func partImage(raw json.RawMessage) (string, error) {
	var u struct {
		URL string `json:"url"`
	}
	if err := json.Unmarshal(raw, &u.URL); err != nil {
		if err := json.Unmarshal(raw, &u); err != nil || u.URL == "" {
			return "", fmt.Errorf("image_url: want {\"url\": \"data:image/...;base64,...\"}")
		}
	}
	return imageURLMarker(u.URL)
}

// Message is one chat message.
type Message struct {
	Role       string  `json:"role"`
	Content    Content `json:"content"`
	Name       string  `json:"name,omitempty"`
	ToolCallID string  `json:"tool_call_id,omitempty"`
	// ToolCalls are an assistant turn's calls ([]ToolCall, decoded when the
	// history is rendered); FunctionCall, the deprecated form, is refused.
	ToolCalls    json.RawMessage `json:"tool_calls,omitempty"`
	FunctionCall json.RawMessage `json:"function_call,omitempty"`
	// noContent: the message came with neither content (or content null)
	// nor tool calls, which OpenAI's API and llama-server refuse.
	noContent bool
}

func (m *Message) UnmarshalJSON(b []byte) error {
	type Fields Message // without this method; the name is dropped from error paths (jsonField)
	var v struct {
		Fields
		Content *Content `json:"content"` // nil: absent or null
	}
	if err := json.Unmarshal(b, &v); err != nil {
		return err
	}
	*m = Message(v.Fields)
	if v.Content != nil {
		m.Content = *v.Content
	}
	m.noContent = v.Content == nil && !given(m.ToolCalls) && !given(m.FunctionCall)
	return nil
}

// StreamOptions is OpenAI's stream_options.
type StreamOptions struct {
	IncludeUsage bool `json:"include_usage"`
	// ContinuousUsageStats is vLLM's: with IncludeUsage, every chunk carries
	// the usage so far.
	ContinuousUsageStats bool `json:"continuous_usage_stats"`
}

// ResponseFormat is OpenAI's response_format.
type ResponseFormat struct {
	Type string `json:"type"`
	// Schema: llama-server's {"type": "json_object", "schema": {...}}.
	Schema     json.RawMessage `json:"schema"`
	JSONSchema *struct {
		Name   string          `json:"name"`
		Schema json.RawMessage `json:"schema"`
		Strict *bool           `json:"strict"`
	} `json:"json_schema"`
}

// SamplingFields are the parameters both endpoints share.
type SamplingFields struct {
	Model             string          `json:"model"`
	MaxTokens         *int            `json:"max_tokens"`
	Temperature       *float64        `json:"temperature"`
	TopP              *float64        `json:"top_p"`
	N                 *int            `json:"n"`
	Stream            bool            `json:"stream"`
	StreamOptions     *StreamOptions  `json:"stream_options"`
	Stop              StringOrList    `json:"stop"`
	Seed              *int64          `json:"seed"`
	PresencePenalty   *float64        `json:"presence_penalty"`
	FrequencyPenalty  *float64        `json:"frequency_penalty"`
	LogitBias         LogitBias       `json:"logit_bias"`
	User              string          `json:"user"`
	ResponseFormat    *ResponseFormat `json:"response_format"`
	TopK              *int            `json:"top_k"`
	MinP              *float64        `json:"min_p"`
	RepetitionPenalty *float64        `json:"repetition_penalty"`
	// RepeatLastN is llama-server's and Ollama's window of repetition_penalty:
	// the last N tokens (64 by default), -1 the whole sequence, 0 none.
	RepeatLastN       *int          `json:"repeat_last_n"`
	Priority          *int          `json:"priority"`
	IgnoreEOS         bool          `json:"ignore_eos"`
	SkipSpecialTokens *bool         `json:"skip_special_tokens"`
	MinTokens         *int          `json:"min_tokens"`
	StopTokenIDs      TokenIDs[int] `json:"stop_token_ids"`
	IncludeStopStr    bool          `json:"include_stop_str_in_output"`
	// PromptLogprobs is vLLM's: score the prompt's tokens, with this many
	// alternatives each (PromptLogprob).
	PromptLogprobs *int `json:"prompt_logprobs"`
	// ReturnTokensAsTokenIDs is vLLM's: logprobs name tokens "token_id:ID",
	// for tokens whose text is not whole UTF-8 or not unique.
	ReturnTokensAsTokenIDs bool `json:"return_tokens_as_token_ids"`
	// vLLM's: AllowedTokenIDs are the only tokens drawn; BadWords are never
	// generated; TruncatePromptTokens keeps the prompt's last k tokens (-1:
	// as many as leave room for a token); UseBeamSearch is refused.
	AllowedTokenIDs      TokenIDs[int] `json:"allowed_token_ids"`
	BadWords             []string      `json:"bad_words"`
	TruncatePromptTokens *int          `json:"truncate_prompt_tokens"`
	UseBeamSearch        bool          `json:"use_beam_search"`
	StructuredFields
	LlamaSamplerFields
	// llamaRanges: temperatures above OpenAI's 2 are taken, as llama.cpp's
	// APIs (llama-server's, Ollama's) take them (llamaMeanings).
	llamaRanges bool
}

// llamaMeanings gives f's values the meanings llama.cpp's samplers give them
// and llama-server and Ollama pass on, where OpenAI's API refuses them: a
// temperature below 0, as top_p 0, draws the likeliest token; one above 2 is
// taken; an empty stop string stops nothing.
func (f *SamplingFields) llamaMeanings() {
	f.llamaRanges = true
	if f.Temperature != nil && *f.Temperature < 0 {
		f.Temperature = new(0.0)
	}
	if f.TopP != nil && *f.TopP <= 0 {
		f.TopP, f.TopK = nil, new(1)
	}
	f.Stop = slices.DeleteFunc(slices.Clone(f.Stop), func(s string) bool { return s == "" })
}

// StructuredFields are the other servers' ways to constrain the output, besides
// response_format: vLLM's guided_* and structured_outputs, llama-server's
// json_schema and grammar. Those shoal cannot honour are refused, not ignored.
type StructuredFields struct {
	GuidedJSON        json.RawMessage    `json:"guided_json"` // a schema, or a string holding one
	GuidedChoice      []string           `json:"guided_choice"`
	GuidedRegex       *string            `json:"guided_regex"`
	GuidedGrammar     *string            `json:"guided_grammar"`
	StructuredOutputs *StructuredOutputs `json:"structured_outputs"`
	JSONSchema        json.RawMessage    `json:"json_schema"`
	Grammar           *string            `json:"grammar"`
}

// StructuredOutputs is vLLM's structured_outputs.
type StructuredOutputs struct {
	JSON       json.RawMessage `json:"json"`
	Choice     []string        `json:"choice"`
	Regex      *string         `json:"regex"`
	Grammar    *string         `json:"grammar"`
	JSONObject bool            `json:"json_object"` // any JSON object
	// StructuralTag (vLLM's, xgrammar's) is refused: no llama.cpp grammar
	// expresses it here.
	StructuralTag json.RawMessage `json:"structural_tag"`
}

// ChatRequest is the body of POST /v1/chat/completions.
type ChatRequest struct {
	SamplingFields
	Messages            []Message `json:"messages"`
	MaxCompletionTokens *int      `json:"max_completion_tokens"`
	// Modalities and Audio ask for spoken output (OpenAI's audio models):
	// refused, as text is all a node writes.
	Modalities  []string        `json:"modalities"`
	Audio       json.RawMessage `json:"audio"`
	Logprobs    bool            `json:"logprobs"`
	TopLogprobs *int            `json:"top_logprobs"`
	ToolFields
	// ChatTemplateKwargs are extra variables for a Jinja chat template, as
	// vLLM's ({"enable_thinking": false} for Qwen 3); without Jinja they have
	// no effect.
	ChatTemplateKwargs json.RawMessage `json:"chat_template_kwargs"`
	// AddGenerationPrompt (default true) and ContinueFinalMessage are vLLM's:
	// how the prompt ends (turnEnd).
	AddGenerationPrompt  *bool `json:"add_generation_prompt"`
	ContinueFinalMessage bool  `json:"continue_final_message"`
}

// ToolFields offer the model tools ([]Tool, decoded by toolsOf so that errors
// name the entry). Functions and FunctionCall, the deprecated form, are read
// to refuse them.
type ToolFields struct {
	Tools             json.RawMessage `json:"tools"`
	ToolChoice        json.RawMessage `json:"tool_choice"`
	ParallelToolCalls *bool           `json:"parallel_tool_calls"`
	Functions         json.RawMessage `json:"functions"`
	FunctionCall      json.RawMessage `json:"function_call"`
}

// CompletionRequest is the body of POST /v1/completions.
type CompletionRequest struct {
	SamplingFields
	Prompt   *Prompt `json:"prompt"`
	Echo     bool    `json:"echo"`
	Logprobs *int    `json:"logprobs"`
	Suffix   *string `json:"suffix"`
	// BestOf is taken as vLLM's V1 engine takes it: as n (best_of equal to n,
	// or 1), any more refused rather than ignored.
	BestOf *int `json:"best_of"`
}

// Usage is OpenAI's usage object.
type Usage struct {
	PromptTokens        int                 `json:"prompt_tokens"`
	CompletionTokens    int                 `json:"completion_tokens"`
	TotalTokens         int                 `json:"total_tokens"`
	PromptTokensDetails PromptTokensDetails `json:"prompt_tokens_details"`
}

// PromptTokensDetails reports prefix-cache hits.
type PromptTokensDetails struct {
	CachedTokens int `json:"cached_tokens"`
}

// ChatMessageOut is an assistant message in a response.
type ChatMessageOut struct {
	Role    string  `json:"role"`
	Content *string `json:"content"` // null when the model called tools
	// ReasoningContent is a reasoning model's thoughts, apart from its answer
	// (llama-server's and DeepSeek's name).
	ReasoningContent *string    `json:"reasoning_content,omitempty"`
	ToolCalls        []ToolCall `json:"tool_calls,omitempty"`
}

// ChatDelta is a streamed chunk's delta.
type ChatDelta struct {
	Role             string          `json:"role,omitempty"`
	Content          *string         `json:"content,omitempty"`
	ReasoningContent *string         `json:"reasoning_content,omitempty"`
	ToolCalls        []ToolCallDelta `json:"tool_calls,omitempty"`
}

// ToolCallDelta is a streamed piece of a call: a call's first has its id,
// type and name, the rest only what its arguments gained.
type ToolCallDelta struct {
	Index    int               `json:"index"`
	ID       string            `json:"id,omitempty"`
	Type     string            `json:"type,omitempty"`
	Function FunctionCallDelta `json:"function"`
}

// FunctionCallDelta is a streamed piece of a call's function.
type FunctionCallDelta struct {
	Name      string `json:"name,omitempty"`
	Arguments string `json:"arguments"`
}

// TopLogprob is one alternative token.
type TopLogprob struct {
	Token   string  `json:"token"`
	Logprob float32 `json:"logprob"`
	Bytes   []int   `json:"bytes"`
}

// TokenLogprob is the chat logprobs entry of one token.
type TokenLogprob struct {
	Token       string       `json:"token"`
	Logprob     float32      `json:"logprob"`
	Bytes       []int        `json:"bytes"`
	TopLogprobs []TopLogprob `json:"top_logprobs"`
}

// ChatLogprobs is a chat choice's logprobs.
type ChatLogprobs struct {
	Content []TokenLogprob `json:"content"`
}

// ChatChoice is one choice of a chat completion.
type ChatChoice struct {
	Index        int            `json:"index"`
	Message      ChatMessageOut `json:"message"`
	Logprobs     *ChatLogprobs  `json:"logprobs"`
	FinishReason string         `json:"finish_reason"`
	StopReason   any            `json:"stop_reason,omitempty"` // vLLM's: the stop string or stop token id that ended it
}

// ChatResponse is the body of a non-streamed chat completion.
type ChatResponse struct {
	ID                string       `json:"id"`
	Object            string       `json:"object"`
	Created           int64        `json:"created"`
	Model             string       `json:"model"`
	SystemFingerprint string       `json:"system_fingerprint"`
	Choices           []ChatChoice `json:"choices"`
	Usage             Usage        `json:"usage"`
	// PromptLogprobs: the prompt's scores, when asked for (vLLM's).
	PromptLogprobs []map[string]PromptLogprob `json:"prompt_logprobs,omitempty"`
}

// ChatChunkChoice is one choice of a streamed chunk.
type ChatChunkChoice struct {
	Index        int           `json:"index"`
	Delta        ChatDelta     `json:"delta"`
	Logprobs     *ChatLogprobs `json:"logprobs"`
	FinishReason *string       `json:"finish_reason"`
	StopReason   any           `json:"stop_reason,omitempty"`
}

// ChatChunk is one SSE event of a streamed chat completion.
type ChatChunk struct {
	ID                string            `json:"id"`
	Object            string            `json:"object"`
	Created           int64             `json:"created"`
	Model             string            `json:"model"`
	SystemFingerprint string            `json:"system_fingerprint"`
	Choices           []ChatChunkChoice `json:"choices"`
	Usage             *Usage            `json:"usage,omitempty"`
}

// CompletionLogprobs is the legacy completions logprobs object.
type CompletionLogprobs struct {
	Tokens        []string         `json:"tokens"`
	TokenLogprobs []*float32       `json:"token_logprobs"` // null for an echoed prompt's first token
	TopLogprobs   []RankedLogprobs `json:"top_logprobs"`   // the token and its alternatives; {} for an echoed prompt's first token
	TextOffset    []int            `json:"text_offset"`
}

// RankedLogprobs is a token's entry in the legacy top_logprobs: an object
// from token text to logprob, written most likely first, as OpenAI and vLLM
// write it (a Go map would come out in alphabetical order). A text is in it
// once: the token's own logprob (it comes first, the alternatives after it),
// or of two alternatives that read alike, the likelier's.
type RankedLogprobs []NamedLogprob

// NamedLogprob is one entry of RankedLogprobs.
type NamedLogprob struct {
	Token   string
	Logprob float32
}

// with is r with token added in its place by logprob, unless r has it.
func (r RankedLogprobs) with(token string, logprob float32) RankedLogprobs {
	if slices.ContainsFunc(r, func(x NamedLogprob) bool { return x.Token == token }) {
		return r
	}
	i := len(r)
	for i > 0 && r[i-1].Logprob < logprob {
		i--
	}
	return slices.Insert(r, i, NamedLogprob{token, logprob})
}

// Logprob is token's logprob in r.
func (r RankedLogprobs) Logprob(token string) (float32, bool) {
	for _, x := range r {
		if x.Token == token {
			return x.Logprob, true
		}
	}
	return 0, false
}

func (r RankedLogprobs) MarshalJSON() ([]byte, error) {
	b := []byte{'{'}
	for i, x := range r {
		if i > 0 {
			b = append(b, ',')
		}
		k, err := json.Marshal(x.Token)
		if err != nil {
			return nil, err
		}
		v, err := json.Marshal(x.Logprob)
		if err != nil {
			return nil, err
		}
		b = append(append(append(b, k...), ':'), v...)
	}
	return append(b, '}'), nil
}

func (r *RankedLogprobs) UnmarshalJSON(b []byte) error {
	dec := json.NewDecoder(bytes.NewReader(b))
	if t, err := dec.Token(); err != nil || t == nil {
		*r = nil
		return err
	} else if t != json.Delim('{') {
		return fmt.Errorf("top_logprobs entry: want an object, got %v", t)
	}
	out := RankedLogprobs{}
	for dec.More() {
		t, err := dec.Token()
		if err != nil {
			return err
		}
		var lp float32
		if err := dec.Decode(&lp); err != nil {
			return err
		}
		out = append(out, NamedLogprob{Token: fmt.Sprint(t), Logprob: lp})
	}
	*r = out
	return nil
}

// PromptLogprob is vLLM's score of a prompt token or one of its alternatives
// (prompt_logprobs: per prompt token, null for the first, a map from token ids
// to these).
type PromptLogprob struct {
	Logprob      float32 `json:"logprob"`
	Rank         int     `json:"rank"` // 1: the most likely token
	DecodedToken string  `json:"decoded_token"`
}

// CompletionChoice is one choice of a completion (streamed or not).
type CompletionChoice struct {
	Index        int                 `json:"index"`
	Text         string              `json:"text"`
	Logprobs     *CompletionLogprobs `json:"logprobs"`
	FinishReason *string             `json:"finish_reason"`
	StopReason   any                 `json:"stop_reason,omitempty"`
	// PromptLogprobs: the prompt's scores, when asked for (vLLM's).
	PromptLogprobs []map[string]PromptLogprob `json:"prompt_logprobs,omitempty"`
}

// CompletionResponse is the body of a completion and of each streamed chunk.
type CompletionResponse struct {
	ID                string             `json:"id"`
	Object            string             `json:"object"`
	Created           int64              `json:"created"`
	Model             string             `json:"model"`
	SystemFingerprint string             `json:"system_fingerprint"`
	Choices           []CompletionChoice `json:"choices"`
	Usage             *Usage             `json:"usage,omitempty"`
}

// Model is an entry of GET /v1/models.
type Model struct {
	ID          string `json:"id"`
	Object      string `json:"object"`
	Created     int64  `json:"created"`
	OwnedBy     string `json:"owned_by"`
	MaxModelLen int    `json:"max_model_len"`
	// Simulated is true when a node serves engine/sim, not a model.
	Simulated bool `json:"simulated,omitempty"`
	// Parent is a LoRA adapter's base model, as vLLM lists adapters.
	Parent string `json:"parent,omitempty"`
}

// ModelList is the body of GET /v1/models.
type ModelList struct {
	Object string  `json:"object"`
	Data   []Model `json:"data"`
}

// TokenizeRequest is the body of POST /tokenize (vLLM's shape).
type TokenizeRequest struct {
	Model            string  `json:"model"`
	Prompt           *string `json:"prompt"`
	AddSpecialTokens *bool   `json:"add_special_tokens"`
	ReturnTokenStrs  bool    `json:"return_token_strs"`
	ChatFields
	// Content asks in llama-server's shape, which SillyTavern's llama.cpp
	// connection sends: the text, add_special (default false), parse_special
	// (default true), with_pieces; answered as LlamaTokenizeResponse.
	Content      *string `json:"content"`
	AddSpecial   bool    `json:"add_special"`
	ParseSpecial *bool   `json:"parse_special"`
	WithPieces   bool    `json:"with_pieces"`
}

// LlamaTokenizeResponse is llama-server's /tokenize answer: token ids, or with
// with_pieces {"id", "piece"} objects whose piece is the token's text, or its
// bytes when they are not whole UTF-8.
type LlamaTokenizeResponse struct {
	Tokens []any `json:"tokens"`
}

// ChatFields are what lays out a chat's prompt without running it (/tokenize,
// /apply-template): the messages, and the tools and the output constraint their
// answers follow, as chat renders them.
type ChatFields struct {
	Messages []Message `json:"messages"`
	ToolFields
	ResponseFormat *ResponseFormat `json:"response_format"`
	StructuredFields
	ChatTemplateKwargs   json.RawMessage `json:"chat_template_kwargs"`
	AddGenerationPrompt  *bool           `json:"add_generation_prompt"`
	ContinueFinalMessage bool            `json:"continue_final_message"`
}

// TokenizeResponse is the body of a /tokenize answer.
type TokenizeResponse struct {
	Count       int      `json:"count"`
	MaxModelLen int      `json:"max_model_len"`
	Tokens      []int32  `json:"tokens"`
	TokenStrs   []string `json:"token_strs,omitempty"` // with return_token_strs, as vLLM's
}

// DetokenizeRequest is the body of POST /detokenize.
type DetokenizeRequest struct {
	Model  string          `json:"model"`
	Tokens TokenIDs[int64] `json:"tokens"`
}

// DetokenizeResponse is the body of a /detokenize answer.
type DetokenizeResponse struct {
	Prompt  string `json:"prompt"`
	Content string `json:"content"` // the same text, as llama-server names it
}

// ErrorBody is OpenAI's error envelope.
type ErrorBody struct {
	Error ErrorDetail `json:"error"`
}

// ErrorDetail is the error object.
type ErrorDetail struct {
	Message string  `json:"message"`
	Type    string  `json:"type"`
	Param   *string `json:"param"`
	Code    *string `json:"code"`
}

// EmbeddingRequest is the body of POST /v1/embeddings.
type EmbeddingRequest struct {
	Model          string  `json:"model"`
	Input          *Prompt `json:"input"` // a string, strings, token ids or lists of them
	EncodingFormat string  `json:"encoding_format"`
	Dimensions     *int    `json:"dimensions"`
	User           string  `json:"user"`
	// TruncatePromptTokens keeps each input's last k tokens (vLLM's; -1: as
	// many as one pass computes).
	TruncatePromptTokens *int `json:"truncate_prompt_tokens"`
	// Normalize false answers the model's vectors as they are (vLLM's; by
	// default, at unit length).
	Normalize *bool `json:"normalize"`
}

// EmbeddingData is one embedding: []float32, or a base64 string.
type EmbeddingData struct {
	Object    string `json:"object"`
	Index     int    `json:"index"`
	Embedding any    `json:"embedding"`
}

// EmbeddingUsage counts the input tokens.
type EmbeddingUsage struct {
	PromptTokens int `json:"prompt_tokens"`
	TotalTokens  int `json:"total_tokens"`
}

// EmbeddingResponse is the body of a /v1/embeddings answer.
type EmbeddingResponse struct {
	Object string          `json:"object"`
	Data   []EmbeddingData `json:"data"`
	Model  string          `json:"model"`
	Usage  EmbeddingUsage  `json:"usage"`
}

// LogitBias is logit_bias in OpenAI's form ({"token id": bias}) or in
// llama-server's, which SillyTavern and other llama.cpp clients send: an object
// whose keys are token ids or texts, or an array of [id or text, value] pairs
// (a string there is always a text); a text's tokens each get the bias, and a
// value of false bans. An empty array is none.
type LogitBias []BiasEntry

// BiasEntry is one logit_bias entry; a ban is the lowest bias, banBias.
type BiasEntry struct {
	ID     int64
	Text   string
	IsText bool
	Bias   float64
}

// banBias is the bias of a banned token (llama-server's false): OpenAI's lowest.
const banBias = -100

// UnmarshalJSON takes an object or an array of pairs.
func (l *LogitBias) UnmarshalJSON(b []byte) error {
	errShape := &fieldError{"logit_bias", errors.New(`logit_bias must be {"token id": bias} or [[token id or text, bias or false], ...]`)}
	var out LogitBias
	// entry reads a key (a text is an id when idText and it is one, as an
	// object's keys are) and a value.
	entry := func(key json.RawMessage, value json.RawMessage, idText bool) error {
		if bytes.Equal(key, []byte("null")) || bytes.Equal(value, []byte("null")) {
			return errShape
		}
		var e BiasEntry
		var s string
		switch {
		case json.Unmarshal(key, &e.ID) == nil:
		case json.Unmarshal(key, &s) == nil:
			// A key of digits is a token id, never a text of digits: as
			// llama-server's strtol reads it (leading spaces, one sign).
			t := strings.TrimLeft(s, " \t\n\v\f\r")
			digits := t
			if t != "" && (t[0] == '+' || t[0] == '-') {
				digits = t[1:]
			}
			if idText && digits != "" && strings.Trim(digits, "0123456789") == "" {
				id, err := strconv.ParseInt(t, 10, 64)
				if err != nil {
					return &fieldError{"logit_bias", fmt.Errorf("logit_bias key %q is not a token id of this model", s)}
				}
				e.ID = id
			} else {
				e.Text, e.IsText = s, true
			}
		default:
			return errShape
		}
		var ban bool
		switch {
		case json.Unmarshal(value, &e.Bias) == nil:
		case json.Unmarshal(value, &ban) == nil && !ban:
			e.Bias = banBias
		default:
			return errShape
		}
		out = append(out, e)
		return nil
	}
	if t := bytes.TrimSpace(b); len(t) > 0 && t[0] == '[' {
		var pairs []json.RawMessage
		if err := json.Unmarshal(t, &pairs); err != nil {
			return errShape
		}
		for _, p := range pairs {
			var kv []json.RawMessage
			if err := json.Unmarshal(p, &kv); err != nil || len(kv) != 2 {
				return errShape
			}
			if err := entry(bytes.TrimSpace(kv[0]), bytes.TrimSpace(kv[1]), false); err != nil {
				return err
			}
		}
		*l = out
		return nil
	}
	var m map[string]json.RawMessage
	if err := json.Unmarshal(b, &m); err != nil {
		return errShape
	}
	for _, k := range slices.Sorted(maps.Keys(m)) {
		key, _ := json.Marshal(k)
		if err := entry(key, bytes.TrimSpace(m[k]), true); err != nil {
			return err
		}
	}
	*l = out
	return nil
}

// maxBiasTokens bounds the tokens one request's logit_bias may touch.
const maxBiasTokens = 4096

// tokens is the bias of each token under v: a text's tokens each get its bias.
func (l LogitBias) tokens(v engine.Vocab) (map[engine.Token]float32, error) {
	out := map[engine.Token]float32{}
	for _, e := range l {
		bias := e.Bias
		if math.IsNaN(bias) || bias < -100 || bias > 100 {
			return nil, invalid("logit_bias", "logit_bias %v: must be between -100 and 100 (or false, banned)", bias)
		}
		ids := []engine.Token{engine.Token(e.ID)}
		if e.IsText {
			toks, err := v.Tokenize(e.Text, false, false)
			if err != nil {
				return nil, err
			}
			ids = toks
		} else if e.ID < 0 || e.ID >= int64(v.Size()) {
			return nil, invalid("logit_bias", "logit_bias key %d is not a token id of this model (0..%d)", e.ID, v.Size()-1)
		}
		for _, id := range ids {
			out[id] = float32(bias)
		}
		if len(out) > maxBiasTokens {
			return nil, invalid("logit_bias", "logit_bias touches more than %d tokens", maxBiasTokens)
		}
	}
	return out, nil
}
