package models

import (
	"cmp"
	"encoding/binary"
	"errors"
	"fmt"
	"hash/fnv"
	"io"
	"math"
	"math/rand/v2"
	"os"
	"strings"

	"github.com/ollama/ollama/fs/ggml"
	"github.com/x448/float16"
)

// Spec describes a generated llama-architecture test model. The weights are seeded random
// numbers, so the model writes nonsense, but it is a real GGUF that llama.cpp loads,
// tokenizes any text with (byte fallback) and decodes with realistic compute per token.
type Spec struct {
	Name       string
	Seed       uint64
	Vocab      int // total tokens, including the 3 specials, 2 chat markers and 256 bytes
	Embd       int
	Layers     int
	Heads      int
	HeadsKV    int
	FFN        int
	ContextLen int
	// F16 stores the matrices as float16 (norms stay float32), halving the file size.
	F16 bool
	// ChatTemplate is written as tokenizer.chat_template ("": the ChatML ChatTemplate).
	ChatTemplate string
	// Meta holds further metadata keys to write, e.g. general.sampling.temp.
	Meta map[string]any
	// ControlTokens are added to the vocabulary as control tokens (in place of
	// its last ones), for templates whose tags are such tokens (MistralTokens).
	ControlTokens []string
	// Reranker writes a reranker as Qwen3-Reranker's GGUF is laid out: Qwen 3's
	// architecture, rank pooling, a head scoring "yes" and "no" (softmax: the
	// first score is the relevance) and a rerank prompt (RerankTemplate).
	Reranker bool
	// Gemma3 writes Gemma 3's architecture (q/k norms, norms after attention
	// and the FFN, a sliding window of 256 on five layers of six, token
	// embeddings scaled by √embd): at least 6 layers. Its projector
	// (GenerateProjector) is Gemma 3's, whose image tokens attend both ways.
	Gemma3 bool
	// QwenVL writes Qwen2-VL's architecture (qwen2vl: a llama block whose
	// RoPE is M-RoPE, its rotary dimensions in sections for a token's time,
	// height and width). Its projector (GenerateProjector) is Qwen2-VL's,
	// which gives each image token a height and width: an image of any size
	// becomes a grid of tokens, over fewer positions than tokens.
	QwenVL bool
	// QwenVL25 (with QwenVL) makes its projector Qwen2.5-VL's: RMS norms, a
	// gated SiLU feed-forward, and window attention in all but every second
	// block of its encoder.
	QwenVL25 bool
	// QwenVL3 (with QwenVL) writes Qwen3-VL's architecture instead (Qwen 3's
	// q/k norms, no biases) with two "deepstack" layers: its projector
	// (Qwen3-VL's: learned positions, fused q/k/v, a merger per deepstack
	// layer) gives each image token features for the first two layers
	// besides its embedding, rows three times the model's width.
	QwenVL3 bool
}

// QwenVLTiny is a ~0.4M-parameter Qwen2-VL model for the tests of M-RoPE
// projectors.
func QwenVLTiny() Spec {
	return Spec{Name: "shoal-qwen2vl-tiny", Seed: 4, Vocab: 1024, Embd: 64, Layers: 2, Heads: 4, HeadsKV: 2, FFN: 192, ContextLen: 4096, QwenVL: true}
}

// QwenVL3Tiny is QwenVLTiny as Qwen3-VL, with its projector.
func QwenVL3Tiny() Spec {
	s := QwenVLTiny()
	s.Name, s.QwenVL3 = "shoal-qwen3vl-tiny", true
	return s
}

// QwenVL25Tiny is QwenVLTiny with Qwen2.5-VL's projector.
func QwenVL25Tiny() Spec {
	s := QwenVLTiny()
	s.Name, s.QwenVL25 = "shoal-qwen25vl-tiny", true
	return s
}

// Gemma3Tiny is a ~0.4M-parameter Gemma 3 model for the tests of Gemma 3's
// projector (six layers: the sliding window needs one global layer).
func Gemma3Tiny() Spec {
	return Spec{Name: "shoal-gemma3-tiny", Seed: 3, Vocab: 1024, Embd: 64, Layers: 6, Heads: 4, HeadsKV: 2, FFN: 192, ContextLen: 4096, Gemma3: true}
}

// RerankTemplate is the rerank prompt written into generated rerankers
// (tokenizer.chat_template.rerank): a ChatML turn asking whether the document
// answers the query, as Qwen3-Reranker's asks.
const RerankTemplate = "<|im_start|>system\nJudge whether the document answers the query. Answer only yes or no.<|im_end|>\n<|im_start|>user\n<Query>: {query}\n<Document>: {document}<|im_end|>\n<|im_start|>assistant\n"

// Tiny is a ~0.23M-parameter model for unit tests: it loads in milliseconds.
func Tiny() Spec {
	return Spec{Name: "shoal-tiny", Seed: 1, Vocab: 1024, Embd: 64, Layers: 2, Heads: 4, HeadsKV: 2, FFN: 192, ContextLen: 4096}
}

// Small is a ~5M-parameter model for tests that need a few layers of real work.
func Small() Spec {
	return Spec{Name: "shoal-small", Seed: 2, Vocab: 4096, Embd: 256, Layers: 4, Heads: 8, HeadsKV: 4, FFN: 704, ContextLen: 4096}
}

// Bench100M is a ~110M-parameter model (768 dims, 12 layers, 16k vocabulary: GPT-2
// small's shape with a llama block) in f16, for benchmarks that need realistic compute
// per token.
func Bench100M() Spec {
	return Spec{Name: "shoal-100m", Seed: 3, Vocab: 16384, Embd: 768, Layers: 12, Heads: 12, HeadsKV: 12, FFN: 2048, ContextLen: 8192, F16: true}
}

// Presets maps the names accepted by `shoal gen-model --preset`.
var Presets = map[string]func() Spec{"tiny": Tiny, "small": Small, "100m": Bench100M, "gemma3-tiny": Gemma3Tiny, "qwen2vl-tiny": QwenVLTiny, "qwen25vl-tiny": QwenVL25Tiny, "qwen3vl-tiny": QwenVL3Tiny}

// ChatTemplate is the Jinja template written into generated models: ChatML, which
// llama.cpp's built-in template matcher recognises by its markers.
const ChatTemplate = "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"

// ToolsTemplate is ChatML that shows tools and earlier calls the way Hermes and
// Qwen models were trained to see them: the tools as JSON in the system turn,
// each call as {"name": ..., "arguments": ...} between <tool_call> tags, and
// tool results between <tool_response> tags in a user turn. Models generated
// with it (gen-model --tools hermes) exercise a model's own call format.
const ToolsTemplate = chatMLToolsHead +
	`Call a function by writing its name and arguments as a JSON object between <tool_call> tags:\n<tool_call>\n{"name": <function name>, "arguments": <arguments as a JSON object>}\n</tool_call>` +
	chatMLToolsTurns + `
            {{- '\n<tool_call>\n{"name": "' + call.function.name + '", "arguments": ' + (call.function.arguments | tojson) + '}\n</tool_call>' }}` +
	chatMLToolsTail

// QwenXMLToolsTemplate lays out tools and calls in the XML form of Qwen3-Coder
// and Qwen 3.5, otherwise as ToolsTemplate: each call a <function=...> with one
// <parameter=...> per argument, strings as raw text and other values as JSON,
// between <tool_call> tags.
const QwenXMLToolsTemplate = chatMLToolsHead +
	`Call a function in this form, one parameter per tag:\n<tool_call>\n<function=name>\n<parameter=key>\nvalue\n</parameter>\n</function>\n</tool_call>` +
	chatMLToolsTurns + `
            {{- '\n<tool_call>\n<function=' + call.function.name + '>\n' }}
            {%- for key, value in call.function.arguments | items %}
                {{- '<parameter=' + key + '>\n' }}
                {%- if value is string %}
                    {{- value }}
                {%- else %}
                    {{- value | tojson }}
                {%- endif %}
                {{- '\n</parameter>\n' }}
            {%- endfor %}
            {{- '</function>\n</tool_call>' }}` +
	chatMLToolsTail

// The parts of the ChatML templates with tools: the system turn up to the
// instructions on calling, the turns up to an earlier call, and the rest.
const (
	chatMLToolsHead = `{%- if tools %}
    {{- '<|im_start|>system\n' }}
    {%- if messages[0].role == 'system' %}
        {{- messages[0].content + '\n\n' }}
    {%- endif %}
    {{- 'These functions can be called, each given as a JSON signature:\n<tools>' }}
    {%- for tool in tools %}
        {{- '\n' + (tool | tojson) }}
    {%- endfor %}
    {{- '\n</tools>\n\n` // the instructions on calling follow
	chatMLToolsTurns = `<|im_end|>\n' }}
{%- elif messages[0].role == 'system' %}
    {{- '<|im_start|>system\n' + messages[0].content + '<|im_end|>\n' }}
{%- endif %}
{%- for message in messages %}
    {%- if message.role == 'user' or (message.role == 'assistant' and not message.tool_calls) %}
        {{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>\n' }}
    {%- elif message.role == 'assistant' %}
        {{- '<|im_start|>assistant' }}
        {%- if message.content %}
            {{- '\n' + message.content }}
        {%- endif %}
        {%- for call in message.tool_calls %}` // an earlier call's layout follows
	chatMLToolsTail = `
        {%- endfor %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role == 'tool' %}
        {{- '<|im_start|>user\n<tool_response>\n' + message.content + '\n</tool_response><|im_end|>\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
{%- endif %}`
)

// Llama3ToolsTemplate lays out tools and calls the way Llama 3.1 to 3.3 were
// trained to see them: the tools as JSON in a system turn, a call as the whole
// assistant turn, {"name": ..., "parameters": ...}, tool results in "ipython"
// turns.
const Llama3ToolsTemplate = `{{- bos_token }}
{%- if tools is defined %}
    {{- '<|start_header_id|>system<|end_header_id|>\n\nAnswer with a JSON call {"name": function name, "parameters": arguments} of one of:\n' }}
    {%- for t in tools %}{{- t | tojson }}{{- '\n' }}{%- endfor %}
    {{- '<|eot_id|>' }}
{%- endif %}
{%- for message in messages %}
    {%- if message.tool_calls is defined %}
        {%- set tool_call = message.tool_calls[0].function %}
        {{- '<|start_header_id|>assistant<|end_header_id|>\n\n{"name": "' + tool_call.name + '", "parameters": ' + (tool_call.arguments | tojson) + '}<|eot_id|>' }}
    {%- elif message.role == 'tool' %}
        {{- '<|start_header_id|>ipython<|end_header_id|>\n\n' + message.content + '<|eot_id|>' }}
    {%- else %}
        {{- '<|start_header_id|>' + message.role + '<|end_header_id|>\n\n' + message.content + '<|eot_id|>' }}
    {%- endif %}
{%- endfor %}
{{- '<|start_header_id|>assistant<|end_header_id|>\n\n' }}`

// GLMToolsTemplate lays out tools and calls the way GLM 4.5 to 4.7 were
// trained to see them: the tools as JSON in the system turn, each call as its
// name then one <arg_key> and <arg_value> per argument (a string as its raw
// text, any other value as JSON) between <tool_call> tags, results between
// <tool_response> tags in an observation turn.
const GLMToolsTemplate = `[gMASK]<sop>
{%- if tools %}<|system|>
These functions can be called, each given as a JSON signature:
<tools>
{% for tool in tools %}{{ tool | tojson }}
{% endfor %}</tools>
Call one in this form, one key and value per argument:
<tool_call>{function-name}
<arg_key>{key}</arg_key>
<arg_value>{value}</arg_value>
</tool_call>
{%- endif %}
{%- for m in messages %}
{%- if m.role == 'user' %}<|user|>
{{ m.content }}
{%- elif m.role == 'assistant' %}<|assistant|>
{%- if m.content %}
{{ m.content }}
{%- endif %}
{%- for tc in m.tool_calls %}
<tool_call>{{ tc.function.name }}
{% for k, v in tc.function.arguments | items %}<arg_key>{{ k }}</arg_key>
<arg_value>{{ v | tojson if v is not string else v }}</arg_value>
{% endfor %}</tool_call>
{%- endfor %}
{%- elif m.role == 'tool' %}<|observation|>
<tool_response>
{{ m.content }}
</tool_response>
{%- elif m.role == 'system' %}<|system|>
{{ m.content }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|assistant|>{% endif %}`

// FIMTokens are Qwen2.5-Coder's fill-in-the-middle control tokens (prefix,
// suffix, middle, pad, repository name, file separator), which llama.cpp finds
// by their text: a model generated with them can serve /infill and suffix.
var FIMTokens = []string{"<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>", "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>"}

// MistralTokens are the control tokens of Mistral's templates, for models
// generated with MistralToolsTemplate or MistralListToolsTemplate.
var MistralTokens = []string{"[INST]", "[/INST]", "[SYSTEM_PROMPT]", "[/SYSTEM_PROMPT]", "[AVAILABLE_TOOLS]", "[/AVAILABLE_TOOLS]",
	"[TOOL_CALLS]", "[ARGS]", "[TOOL_RESULTS]", "[/TOOL_RESULTS]"}

// MistralToolsTemplate lays out tools and calls the way Mistral's models from
// tokenizer v11 on (Mistral Small 3.2, Magistral, Devstral) were trained to see
// them: the tools as JSON between [AVAILABLE_TOOLS] tags, each call as
// [TOOL_CALLS]name[ARGS]{arguments}, results between [TOOL_RESULTS] tags. Its
// tags are control tokens (MistralTokens).
const MistralToolsTemplate = mistralHead + `
        {%- for call in message.tool_calls %}
            {{- '[TOOL_CALLS]' + call.function.name + '[ARGS]' + (call.function.arguments | tojson) }}
        {%- endfor %}` + mistralTail + `
        {{- '[TOOL_RESULTS]' + message.content + '[/TOOL_RESULTS]' }}` + mistralEnd

// MistralListToolsTemplate lays out calls as Mistral's earlier models (7B
// v0.3, Nemo, Small 3.1) were trained to see them: one JSON list after
// [TOOL_CALLS], each call with an id of 9 letters and digits, which it
// refuses others than, as those templates do.
const MistralListToolsTemplate = mistralHead + `
        {{- '[TOOL_CALLS][' }}
        {%- for call in message.tool_calls %}
            {%- if call.id is not defined or call.id | length != 9 %}
                {{- raise_exception('Tool call IDs should be alphanumeric strings with length 9!') }}
            {%- endif %}
            {{- '{"name": "' + call.function.name + '", "arguments": ' + (call.function.arguments | tojson) + ', "id": "' + call.id + '"}' }}
            {%- if not loop.last %}{{- ', ' }}{%- endif %}
        {%- endfor %}
        {{- ']' }}` + mistralTail + `
        {%- if message.tool_call_id is not defined or message.tool_call_id | length != 9 %}
            {{- raise_exception('Tool call IDs should be alphanumeric strings with length 9!') }}
        {%- endif %}
        {{- '[TOOL_RESULTS]{"content": ' + (message.content | tojson) + ', "call_id": "' + message.tool_call_id + '"}[/TOOL_RESULTS]' }}` + mistralEnd

// The parts of the Mistral templates: up to an assistant turn's calls, from
// them to a tool result, and the rest.
const (
	mistralHead = `{{- bos_token }}
{%- set loop_messages = messages %}
{%- if messages[0].role == 'system' %}
    {{- '[SYSTEM_PROMPT]' + messages[0].content + '[/SYSTEM_PROMPT]' }}
    {%- set loop_messages = messages[1:] %}
{%- endif %}
{%- if tools %}
    {{- '[AVAILABLE_TOOLS]' + (tools | tojson) + '[/AVAILABLE_TOOLS]' }}
{%- endif %}
{%- for message in loop_messages %}
    {%- if message.role == 'user' %}
        {{- '[INST]' + message.content + '[/INST]' }}
    {%- elif message.role == 'assistant' and message.tool_calls %}
        {{- message.content }}` // the calls' layout follows
	mistralTail = `
        {{- eos_token }}
    {%- elif message.role == 'assistant' %}
        {{- message.content + eos_token }}
    {%- elif message.role == 'tool' %}` // a result's layout follows
	mistralEnd = `
    {%- endif %}
{%- endfor %}`
)

// Token ids fixed by the generated vocabulary.
const (
	TokenUnknown = 0
	TokenBOS     = 1
	TokenEOS     = 2
	TokenIMStart = 3
	TokenIMEnd   = 4
	firstByte    = 5
)

// GGUF tensor kinds (ggml_type).
const (
	kindF32 = 0
	kindF16 = 1
)

// SentencePiece token types as stored in tokenizer.ggml.token_type.
const (
	tokenNormal  = 1
	tokenUnknown = 2
	tokenControl = 3
	tokenByte    = 6
)

// Validate rejects specs that llama.cpp would refuse or that make no sense.
func (s Spec) Validate() error {
	switch {
	case s.Vocab < firstByte+256+64:
		return fmt.Errorf("vocab %d: need at least %d tokens", s.Vocab, firstByte+256+64)
	case s.Embd <= 0 || s.Layers <= 0 || s.Heads <= 0 || s.HeadsKV <= 0 || s.FFN <= 0 || s.ContextLen <= 0:
		return errors.New("embd, layers, heads, heads_kv, ffn and context length must be positive")
	case s.Embd%s.Heads != 0:
		return fmt.Errorf("embd %d is not a multiple of heads %d", s.Embd, s.Heads)
	case s.Heads%s.HeadsKV != 0:
		return fmt.Errorf("heads %d is not a multiple of heads_kv %d", s.Heads, s.HeadsKV)
	case (s.Embd/s.Heads)%2 != 0:
		return fmt.Errorf("head size %d must be even for RoPE", s.Embd/s.Heads)
	case len(s.ControlTokens) > 64:
		return fmt.Errorf("%d control tokens: at most 64", len(s.ControlTokens))
	case s.Gemma3 && s.Layers < 6:
		return fmt.Errorf("a Gemma 3 model of %d layers: llama.cpp's sliding window needs at least 6 (one global layer in six)", s.Layers)
	case s.Gemma3 && s.Reranker:
		return errors.New("a Gemma 3 reranker is not written")
	case s.QwenVL && (s.Gemma3 || s.Reranker):
		return errors.New("a Qwen2-VL model is neither Gemma 3 nor a reranker")
	case (s.QwenVL25 || s.QwenVL3) && !s.QwenVL, s.QwenVL25 && s.QwenVL3:
		return errors.New("Qwen2.5-VL's and Qwen3-VL's projectors are for a Qwen2-VL model (QwenVL), one of them")
	case s.QwenVL25 && !s.QwenVL:
		return errors.New("Qwen2.5-VL's projector is for a Qwen2-VL model (QwenVL)")
	case s.QwenVL && s.Embd/s.Heads < 8:
		return fmt.Errorf("head size %d: Qwen2-VL's M-RoPE needs at least 8", s.Embd/s.Heads)
	}
	return nil
}

// Params is the number of weights the spec produces.
func (s Spec) Params() int64 {
	e, v, f := int64(s.Embd), int64(s.Vocab), int64(s.FFN)
	kv := e / int64(s.Heads) * int64(s.HeadsKV)
	layer := 2*e + e*e*2 + 2*e*kv + 3*e*f
	n := 2*e*v + e + int64(s.Layers)*layer
	if s.Reranker {
		n += int64(s.Layers)*2*(e/int64(s.Heads)) + 2*e // q and k norms, the head
	}
	if s.Gemma3 {
		n += int64(s.Layers) * (2*(e/int64(s.Heads)) + 2*e) // q and k norms, two more norms
	}
	if s.QwenVL {
		n += int64(s.Layers) * (e + 2*kv) // q, k and v biases
	}
	return n
}

// Generate writes the model described by spec to path.
func Generate(path string, spec Spec) error {
	if err := spec.Validate(); err != nil {
		return fmt.Errorf("generate %s: %w", path, err)
	}
	tokens, scores, types := vocabulary(spec.Vocab)
	for i, t := range spec.ControlTokens {
		k := len(tokens) - len(spec.ControlTokens) + i
		tokens[k], scores[k], types[k] = t, 0, tokenControl
	}
	seen := make(map[string]int, len(tokens))
	for i, t := range tokens {
		if j, dup := seen[t]; dup {
			return fmt.Errorf("generate %s: control token %q is token %d of the vocabulary already", path, t, j)
		}
		seen[t] = i
	}
	fileType := uint32(0)
	if spec.F16 {
		fileType = 1
	}
	headDim := spec.Embd / spec.Heads
	arch := "llama"
	switch {
	case spec.Reranker:
		arch = "qwen3"
	case spec.Gemma3:
		arch = "gemma3"
	case spec.QwenVL3:
		arch = "qwen3vl"
	case spec.QwenVL:
		arch = "qwen2vl"
	}
	kv := ggml.KV{
		"general.architecture":                     arch,
		"general.name":                             spec.Name,
		"general.file_type":                        fileType,
		"general.alignment":                        uint32(32),
		arch + ".context_length":                   uint32(spec.ContextLen),
		arch + ".embedding_length":                 uint32(spec.Embd),
		arch + ".block_count":                      uint32(spec.Layers),
		arch + ".feed_forward_length":              uint32(spec.FFN),
		arch + ".attention.head_count":             uint32(spec.Heads),
		arch + ".attention.head_count_kv":          uint32(spec.HeadsKV),
		arch + ".rope.dimension_count":             uint32(headDim),
		arch + ".rope.freq_base":                   float32(10000),
		arch + ".attention.layer_norm_rms_epsilon": float32(1e-5),
		arch + ".vocab_size":                       uint32(spec.Vocab),
		"tokenizer.ggml.model":                     "llama",
		"tokenizer.ggml.tokens":                    tokens,
		"tokenizer.ggml.scores":                    scores,
		"tokenizer.ggml.token_type":                types,
		"tokenizer.ggml.bos_token_id":              uint32(TokenBOS),
		// ChatML ends a turn with <|im_end|>: making it EOS makes it the model's one
		// end-of-generation token, as llama.cpp expects.
		"tokenizer.ggml.eos_token_id":     uint32(TokenIMEnd),
		"tokenizer.ggml.unknown_token_id": uint32(TokenUnknown),
		"tokenizer.ggml.add_bos_token":    true,
		"tokenizer.ggml.add_eos_token":    false,
		"tokenizer.chat_template":         cmp.Or(spec.ChatTemplate, ChatTemplate),
	}

	if spec.Gemma3 {
		kv[arch+".attention.key_length"] = uint32(headDim)
		kv[arch+".attention.value_length"] = uint32(headDim)
		kv[arch+".attention.sliding_window"] = uint32(256)
	}
	if spec.QwenVL {
		// The rotary pairs (half the head) in sections for time, height and
		// width, as Qwen2-VL's 16, 24, 24 of 64.
		pairs := headDim / 2
		t := pairs / 4
		kv[arch+".rope.dimension_sections"] = []int32{int32(t), int32((pairs - t) / 2), int32(pairs - t - (pairs-t)/2), 0}
	}
	if spec.QwenVL3 {
		kv[arch+".n_deepstack_layers"] = uint32(qwen3Deepstack)
	}
	if spec.Reranker {
		kv[arch+".pooling_type"] = uint32(4) // LLAMA_POOLING_TYPE_RANK
		kv[arch+".classifier.output_labels"] = []string{"yes", "no"}
		kv["tokenizer.chat_template.rerank"] = RerankTemplate
	}
	for k, v := range spec.Meta {
		kv[k] = v
	}

	e, v, ff := uint64(spec.Embd), uint64(spec.Vocab), uint64(spec.FFN)
	ekv := uint64(headDim * spec.HeadsKV)
	var ts []*ggml.Tensor
	add := func(name string, scale float32, matrix bool, shape ...uint64) {
		kind := uint32(kindF32)
		if matrix && spec.F16 {
			kind = kindF16
		}
		ts = append(ts, randomWeights(spec.Seed, name, kind, scale, shape...))
	}
	norm := func(name string) { add(name, 0, false, e) }
	std := func(fanIn uint64) float32 { return float32(1 / math.Sqrt(float64(fanIn))) }

	embdScale := float32(1)
	if spec.Gemma3 {
		embdScale = std(e) // Gemma scales token embeddings by √embd
	}
	add("token_embd.weight", embdScale, true, e, v)
	norm("output_norm.weight")
	// A larger output scale than 1/sqrt(fan-in) makes next-token distributions peaked, so
	// greedy choices are far from ties and batched == sequential comparisons are robust.
	add("output.weight", 4*std(e), true, e, v)
	for i := range spec.Layers {
		p := fmt.Sprintf("blk.%d.", i)
		norm(p + "attn_norm.weight")
		add(p+"attn_q.weight", std(e), true, e, e)
		add(p+"attn_k.weight", std(e), true, e, ekv)
		add(p+"attn_v.weight", std(e), true, e, ekv)
		add(p+"attn_output.weight", std(e), true, e, e)
		if spec.QwenVL && !spec.QwenVL3 { // Qwen 2's q, k and v have biases
			add(p+"attn_q.bias", 0.1, false, e)
			add(p+"attn_k.bias", 0.1, false, ekv)
			add(p+"attn_v.bias", 0.1, false, ekv)
		}
		if spec.Reranker || spec.Gemma3 || spec.QwenVL3 {
			add(p+"attn_q_norm.weight", 0, false, uint64(headDim))
			add(p+"attn_k_norm.weight", 0, false, uint64(headDim))
		}
		if spec.Gemma3 {
			norm(p + "post_attention_norm.weight")
			norm(p + "post_ffw_norm.weight")
		}
		norm(p + "ffn_norm.weight")
		add(p+"ffn_gate.weight", std(e), true, e, ff)
		add(p+"ffn_up.weight", std(e), true, e, ff)
		add(p+"ffn_down.weight", std(ff), true, ff, e)
	}
	if spec.Reranker {
		add("cls.output.weight", std(e)/4, true, e, 2)
	}
	if err := writeGGUF(path, kv, ts); err != nil {
		return fmt.Errorf("generate %s: %w", path, err)
	}
	return nil
}

// randomWeights is tensor name of shape, seeded random numbers times scale
// (ones where scale is 0), drawn from seed and the name as it is written.
func randomWeights(seed uint64, name string, kind uint32, scale float32, shape ...uint64) *ggml.Tensor {
	return &ggml.Tensor{Name: name, Kind: kind, Shape: shape,
		WriterTo: &randomTensor{seed: tensorSeed(seed, name), n: product(shape), scale: scale, kind: kind}}
}

// writeGGUF writes a GGUF of kv and ts to path.
func writeGGUF(path string, kv ggml.KV, ts []*ggml.Tensor) (err error) {
	f, err := os.Create(path)
	if err != nil {
		return err
	}
	defer func() {
		if cerr := f.Close(); err == nil && cerr != nil {
			err = cerr
		}
	}()
	if err := ggml.WriteGGUF(f, kv, ts); err != nil {
		return fmt.Errorf("write gguf: %w", err)
	}
	return nil
}

// vocabulary builds a SentencePiece-style vocabulary: specials, ChatML markers, the 256
// byte-fallback tokens, single characters, then a prefix-closed set of letter strings
// (with and without the word-start marker) so that the SPM merge procedure reaches every
// piece. Longer pieces score higher, so merges prefer them.
func vocabulary(n int) ([]string, []float32, []int32) {
	tokens := []string{"<unk>", "<s>", "</s>", "<|im_start|>", "<|im_end|>"}
	types := []int32{tokenUnknown, tokenControl, tokenControl, tokenControl, tokenControl}
	for b := range 256 {
		tokens = append(tokens, fmt.Sprintf("<0x%02X>", b))
		types = append(types, tokenByte)
	}
	seen := map[string]bool{}
	push := func(s string) {
		if len(tokens) < n && !seen[s] {
			seen[s] = true
			tokens = append(tokens, s)
			types = append(types, tokenNormal)
		}
	}
	const letters = "etaoinshrdlucmfwypvbgkjqxz"
	for _, c := range "▁" + letters + strings.ToUpper(letters) + ".,!?'\"-:;()0123456789\n" {
		push(string(c))
	}
	// Breadth-first over strings of common letters: every prefix is pushed before its
	// extensions, which keeps the set prefix-closed.
	level := []string{""}
	for len(tokens) < n {
		var next []string
		for _, p := range level {
			for _, c := range letters {
				next = append(next, p+string(c))
			}
		}
		for _, s := range next {
			push("▁" + s)
			push(s)
		}
		level = next
	}
	scores := make([]float32, len(tokens))
	for i, t := range tokens {
		if types[i] == tokenNormal {
			scores[i] = float32(len([]rune(t))) - float32(i)/float32(n)
		}
	}
	return tokens, scores, types
}

func tensorSeed(seed uint64, name string) uint64 {
	h := fnv.New64a()
	_, _ = h.Write([]byte(name))
	return h.Sum64() ^ seed
}

func product(shape []uint64) uint64 {
	n := uint64(1)
	for _, d := range shape {
		n *= d
	}
	return n
}

// randomTensor writes n normally distributed values times scale (ones where scale is 0)
// from its own seeded generator, so tensors can be written concurrently and identically.
type randomTensor struct {
	seed  uint64
	n     uint64
	scale float32
	kind  uint32
}

func (t *randomTensor) WriteTo(w io.Writer) (int64, error) {
	rng := rand.New(rand.NewPCG(t.seed, 0x5348_4f41_4c)) // "SHOAL"
	size := 4
	if t.kind == kindF16 {
		size = 2
	}
	buf := make([]byte, 0, 64<<10)
	var written int64
	for i := uint64(0); i < t.n; i++ {
		x := float32(1)
		if t.scale != 0 {
			x = float32(rng.NormFloat64()) * t.scale
		}
		if t.kind == kindF16 {
			buf = binary.LittleEndian.AppendUint16(buf, float16.Fromfloat32(x).Bits())
		} else {
			buf = binary.LittleEndian.AppendUint32(buf, math.Float32bits(x))
		}
		if len(buf)+size > cap(buf) || i == t.n-1 {
			n, err := w.Write(buf)
			written += int64(n)
			if err != nil {
				return written, err
			}
			buf = buf[:0]
		}
	}
	return written, nil
}

// GenerateLoRA writes a LoRA adapter for the model spec describes: seeded
// random low-rank updates of rank r to every layer's attention query and value
// matrices (adapter.lora.alpha r, so llama.cpp applies them at scale 1), in
// the GGUF layout llama.cpp's converter writes (lora_a of shape [in, r],
// lora_b of [r, out]). seed 0 takes the spec's. The updates are large enough
// to change the model's greedy choices.
func GenerateLoRA(path string, spec Spec, r int, seed uint64) error {
	if err := spec.Validate(); err != nil {
		return fmt.Errorf("generate LoRA %s: %w", path, err)
	}
	if r < 1 || r > spec.Embd {
		return fmt.Errorf("generate LoRA %s: rank %d: want 1..%d", path, r, spec.Embd)
	}
	if spec.Gemma3 || spec.QwenVL || spec.Reranker {
		// llama.cpp loads an adapter only on a model of its architecture.
		arch := "the " + spec.Name + " preset's"
		if spec.Reranker {
			arch = "a reranker's (qwen3)"
		}
		return fmt.Errorf("generate LoRA %s: adapters are written for the llama-architecture models, not %s", path, arch)
	}
	seed = cmp.Or(seed, spec.Seed) ^ 0x4c6f5241 // "LoRA": not the base weights' draws
	kv := ggml.KV{
		"general.architecture":      "llama",
		"general.type":              "adapter",
		"general.name":              spec.Name + "-lora",
		"general.alignment":         uint32(32),
		"adapter.type":              "lora",
		"adapter.lora.alpha":        float32(r),
		"general.base_model.count":  uint32(1),
		"general.base_model.0.name": spec.Name,
	}
	e, rank := uint64(spec.Embd), uint64(r)
	ekv := uint64(spec.Embd / spec.Heads * spec.HeadsKV)
	var ts []*ggml.Tensor
	add := func(name string, scale float32, shape ...uint64) {
		ts = append(ts, randomWeights(seed, name, kindF32, scale, shape...))
	}
	for i := range spec.Layers {
		for _, w := range []struct {
			name    string
			in, out uint64
		}{{"attn_q", e, e}, {"attn_v", e, ekv}} {
			p := fmt.Sprintf("blk.%d.%s.weight", i, w.name)
			add(p+".lora_a", float32(1/math.Sqrt(float64(w.in))), w.in, rank)
			add(p+".lora_b", float32(1/math.Sqrt(float64(rank))), rank, w.out)
		}
	}
	if err := writeGGUF(path, kv, ts); err != nil {
		return fmt.Errorf("generate LoRA %s: %w", path, err)
	}
	return nil
}

// qwen3Deepstack is how many layers of a generated Qwen3-VL model read an
// image token's deepstack features: as many as its projector's encoder has
// blocks.
const qwen3Deepstack = 2

// ProjectorImageSize and ProjectorPatchSize are a generated projector's
// image and patch sides by default: an image becomes (32/8)² = 16 tokens.
const (
	ProjectorImageSize = 32
	ProjectorPatchSize = 8
)

// GenerateProjector writes a multimodal projector for the model spec
// describes, laid out as LLaVA's (llama.cpp's "mlp" projector): a small
// vision transformer over 8×8 patches of an image scaled to side×side
// pixels (0: ProjectorImageSize; a multiple of 8), then two linear layers to
// the model's embedding width; an image becomes (side/8)² tokens (LLaVA
// 1.5's 576 with side 192). For a Gemma 3 spec it is Gemma 3's projector
// instead (the patch grid pooled 2×2, then an RMS norm and one projection;
// its image tokens attend both ways): (side/16)² tokens, side a multiple of
// 16. For a Qwen2-VL spec it is Qwen2-VL's (two patch kernels, q/k/v
// biases, M-RoPE over each patch's height and width, then 2×2 patches merged
// by two linear layers): an image of any size becomes a grid of tokens, one
// per 16×16 pixels of it scaled to between 8 and 4096 tokens, side unused
// but written. Its weights are seeded random numbers, so it
// sees nothing, but different pictures give different embeddings, as
// llama.cpp's mtmd loads and computes it.
func GenerateProjector(path string, spec Spec, side int) error {
	if err := spec.Validate(); err != nil {
		return fmt.Errorf("generate projector %s: %w", path, err)
	}
	const d, ff, hidden, blocks, heads, patch = 32, 64, 64, 2, 4, ProjectorPatchSize
	side = cmp.Or(side, ProjectorImageSize)
	unit := patch // Gemma 3's pools its patch grid by 2×2, Qwen2-VL's merges it
	if spec.Gemma3 || spec.QwenVL {
		unit = 2 * patch
	}
	if side < unit || side%unit != 0 || side > 1024 {
		return fmt.Errorf("generate projector %s: image side %d: want a multiple of %d up to 1024", path, side, unit)
	}
	seed := spec.Seed ^ 0x636c6970 // "clip": not the model's draws
	kv := ggml.KV{
		"general.architecture":                     "clip",
		"general.name":                             spec.Name + "-mmproj",
		"general.alignment":                        uint32(32),
		"clip.projector_type":                      "mlp",
		"clip.has_vision_encoder":                  true,
		"clip.use_gelu":                            true,
		"clip.vision.image_size":                   uint32(side),
		"clip.vision.patch_size":                   uint32(patch),
		"clip.vision.embedding_length":             uint32(d),
		"clip.vision.feed_forward_length":          uint32(ff),
		"clip.vision.block_count":                  uint32(blocks),
		"clip.vision.attention.head_count":         uint32(heads),
		"clip.vision.attention.layer_norm_epsilon": float32(1e-5),
		"clip.vision.projection_dim":               uint32(spec.Embd),
		"clip.vision.image_mean":                   []float32{0.5, 0.5, 0.5},
		"clip.vision.image_std":                    []float32{0.5, 0.5, 0.5},
	}
	var ts []*ggml.Tensor
	add := func(name string, scale float32, shape ...uint64) {
		ts = append(ts, randomWeights(seed, name, kindF32, scale, shape...))
	}
	std := func(fanIn uint64) float32 { return float32(1 / math.Sqrt(float64(fanIn))) }
	n := uint64((side / patch) * (side / patch))
	add("v.patch_embd.weight", std(3*patch*patch), patch, patch, 3, d)
	if spec.QwenVL {
		// A second kernel (Qwen2-VL's two frames of a video; one image is
		// both), no learned positions (M-RoPE places the patches), and the
		// 2×2 merger to the model's width.
		kv["clip.projector_type"] = "qwen2vl_merger"
		if spec.QwenVL25 {
			kv["clip.projector_type"], kv["clip.vision.n_wa_pattern"] = "qwen2.5vl_merger", uint32(2)
			kv["clip.use_gelu"], kv["clip.use_silu"] = false, true
		}
		add("v.patch_embd.weight.1", std(3*patch*patch), patch, patch, 3, d)
		if spec.QwenVL3 {
			// Learned positions on a 4×4 grid (interpolated to the
			// picture's), a patch bias, and a merger per deepstack layer.
			kv["clip.projector_type"] = "qwen3vl_merger"
			add("v.patch_embd.bias", 0.1, d)
			add("v.position_embd.weight", 0.1, d, 16)
			for i := range qwen3Deepstack {
				p := fmt.Sprintf("v.deepstack.%d.", i)
				add(p+"norm.weight", 0, 4*d)
				add(p+"norm.bias", 0, 4*d)
				add(p+"fc1.weight", std(4*d), 4*d, 4*d)
				add(p+"fc1.bias", 0.1, 4*d)
				add(p+"fc2.weight", 2*std(4*d), 4*d, uint64(spec.Embd))
				add(p+"fc2.bias", 0.1, uint64(spec.Embd))
			}
		}
		add("mm.0.weight", std(4*d), 4*d, 4*d)
		add("mm.0.bias", 0.1, 4*d)
		add("mm.2.weight", 2*std(4*d), 4*d, uint64(spec.Embd))
		add("mm.2.bias", 0.1, uint64(spec.Embd))
	} else {
		add("v.position_embd.weight", 0.1, d, n)
	}
	if spec.Gemma3 {
		// SigLIP's tower (as LLaVA's, here), the patch grid pooled 2×2, an
		// RMS norm and one projection to the model's width.
		kv["clip.projector_type"] = "gemma3"
		kv["clip.vision.projector.scale_factor"] = uint32(2)
		add("mm.soft_emb_norm.weight", 0, d)
		add("mm.input_projection.weight", std(d), uint64(spec.Embd), d)
	}
	for i := range blocks {
		p := fmt.Sprintf("v.blk.%d.", i)
		add(p+"ln1.weight", 0, d)
		add(p+"ln2.weight", 0, d)
		if spec.QwenVL3 { // q, k and v fused
			add(p+"attn_qkv.weight", std(d), d, 3*d)
			add(p+"attn_qkv.bias", 0.1, 3*d)
			add(p+"attn_out.weight", std(d), d, d)
		}
		for _, w := range []string{"attn_q", "attn_k", "attn_v", "attn_out"} {
			if spec.QwenVL3 {
				break
			}
			add(p+w+".weight", std(d), d, d)
			if spec.QwenVL && w != "attn_out" {
				add(p+w+".bias", 0.1, d)
			}
		}
		add(p+"ffn_up.weight", std(d), d, ff)
		add(p+"ffn_down.weight", std(ff), ff, d)
		if spec.QwenVL25 {
			add(p+"ffn_gate.weight", std(d), d, ff)
		}
	}
	if !spec.Gemma3 && !spec.QwenVL {
		add("mm.0.weight", std(d), d, hidden)
		add("mm.0.bias", 0.1, hidden)
		// Embeddings about as large as the model's token embeddings (scale 1).
		add("mm.2.weight", 2*std(hidden), hidden, uint64(spec.Embd))
		add("mm.2.bias", 0.1, uint64(spec.Embd))
	}
	if err := writeGGUF(path, kv, ts); err != nil {
		return fmt.Errorf("generate projector %s: %w", path, err)
	}
	return nil
}
