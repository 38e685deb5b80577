package main

import (
	"flag"
	"fmt"
	"os"
	"slices"
	"strconv"
	"strings"
)

// A serveAlias is llama-server's or vLLM's spelling of a serve flag, so that
// their command lines start shoal as they are: `shoal serve model.gguf -c 8192
// -ngl 99 -fa on`.
type serveAlias struct {
	flag string // the serve flag it spells; "" for one accepted without effect
	// set is the value a flag without one sets (--no-mmap: mmap=false).
	set string
	// value translates a given value to the flag's (-n -1: 0); nil: as given.
	value func(string) (string, error)
	// optional: without a value (the next argument is a flag, or none) the
	// flag is set to set (llama-server's older `-fa` alone).
	optional bool
	// takesValue: an alias without effect that reads a value (--tool-call-parser).
	takesValue bool
	from       string // whose spelling
	note       string // for the help: what it does in shoal, when not plain
}

const (
	fromLlama = "llama-server"
	fromVLLM  = "vLLM"
)

// serveAliases maps each alias (without dashes) to the serve flag it spells.
var serveAliases = map[string]serveAlias{
	"m":                        {flag: "model", from: fromLlama},
	"a":                        {flag: "model-name", from: fromLlama},
	"alias":                    {flag: "model-name", from: fromLlama},
	"c":                        {flag: "ctx-size", from: fromLlama},
	"np":                       {flag: "parallel", from: fromLlama, note: "the running sequences are at most this many"},
	"b":                        {flag: "batch-size", from: fromLlama},
	"ub":                       {flag: "ubatch-size", from: fromLlama},
	"t":                        {flag: "threads", from: fromLlama},
	"tb":                       {flag: "threads-batch", from: fromLlama},
	"ngl":                      {flag: "n-gpu-layers", value: gpuLayers, from: fromLlama, note: "all or auto: -1"},
	"gpu-layers":               {flag: "n-gpu-layers", value: gpuLayers, from: fromLlama, note: "all or auto: -1"},
	"mg":                       {flag: "main-gpu", from: fromLlama},
	"ts":                       {flag: "tensor-split", from: fromLlama},
	"fa":                       {flag: "flash-attn", set: "on", optional: true, from: fromLlama, note: "alone: on, as llama-server's older bool"},
	"ctk":                      {flag: "kv-type-k", from: fromLlama},
	"ctv":                      {flag: "kv-type-v", from: fromLlama},
	"cache-type-k":             {flag: "kv-type-k", from: fromLlama},
	"cache-type-v":             {flag: "kv-type-v", from: fromLlama},
	"kvu":                      {flag: "kv-unified", from: fromLlama},
	"no-mmap":                  {flag: "mmap", set: "false", from: fromLlama},
	"n":                        {flag: "default-max-tokens", value: nPredict, from: fromLlama, note: "-1 is 0: until the end"},
	"n-predict":                {flag: "default-max-tokens", value: nPredict, from: fromLlama, note: "-1 is 0: until the end"},
	"embedding":                {flag: "embeddings", from: fromLlama},
	"rerank":                   {flag: "reranking", from: fromLlama},
	"ssl-key-file":             {flag: "tls-key", from: fromLlama},
	"ssl-cert-file":            {flag: "tls-cert", from: fromLlama},
	"cb":                       {from: fromLlama, note: "batching is always continuous"},
	"cont-batching":            {from: fromLlama, note: "batching is always continuous"},
	"metrics":                  {from: fromLlama, note: "/metrics is always served"},
	"served-model-name":        {flag: "model-name", from: fromVLLM, note: "one or more names, as vLLM's"},
	"max-num-seqs":             {flag: "max-running", from: fromVLLM},
	"max-num-batched-tokens":   {flag: "max-batch-tokens", from: fromVLLM},
	"block-size":               {flag: "block-tokens", from: fromVLLM},
	"enable-prefix-caching":    {flag: "prefix-caching", set: "true", from: fromVLLM},
	"no-enable-prefix-caching": {flag: "prefix-caching", set: "false", from: fromVLLM},
	"disable-log-requests":     {flag: "log-requests", set: "false", from: fromVLLM},
	"enable-log-requests":      {flag: "log-requests", set: "true", from: fromVLLM},
	"ssl-keyfile":              {flag: "tls-key", from: fromVLLM},
	"ssl-certfile":             {flag: "tls-cert", from: fromVLLM},
	"enable-auto-tool-choice":  {from: fromVLLM, note: "tool calls are read in the chat template's own format"},
	"tool-call-parser":         {takesValue: true, from: fromVLLM, note: "the call format is the chat template's own"},
	"reasoning-parser":         {takesValue: true, from: fromVLLM, note: "thoughts are found by --reasoning-format auto"},
	"enable-lora":              {from: fromVLLM, note: "--lora-modules is enough"},
}

// isModelFile reports whether arg names the model rather than another name:
// a .gguf, or a file there is (an Ollama blob has no extension).
func isModelFile(arg string) bool { return strings.HasSuffix(arg, ".gguf") || isFile(arg) }

// isFile reports whether path is a regular file.
func isFile(path string) bool {
	st, err := os.Stat(path)
	return err == nil && st.Mode().IsRegular()
}

// optionalValues are the values an alias whose value is optional (-fa) takes
// from the next argument.
var optionalValues = []string{"on", "off", "auto", "true", "false", "1", "0"}

// gpuLayers reads llama-server's -ngl, which also takes all and auto.
func gpuLayers(v string) (string, error) {
	if v == "all" || v == "auto" {
		return "-1", nil
	}
	return v, nil
}

// nPredict reads llama-server's -n: -1 (its default) is no limit, shoal's 0.
func nPredict(v string) (string, error) {
	n, err := strconv.Atoi(v)
	if err != nil {
		return "", fmt.Errorf("-n %q: want a number of tokens (-1: until the end)", v)
	}
	return strconv.Itoa(max(n, 0)), nil
}

// serveArgs rewrites args spelled as llama-server's or vLLM's (serveAliases)
// into serve's own flags and takes a model path given as an argument rather
// than a flag (`vllm serve MODEL`, anywhere among the flags). It returns the
// rewritten arguments, the model path ("" for none) and the flags accepted
// without effect.
func serveArgs(fs *flag.FlagSet, args []string) (out []string, model string, ignored []string, err error) {
	isBool := func(name string) bool {
		fl := fs.Lookup(name)
		b, ok := fl.Value.(interface{ IsBoolFlag() bool })
		return ok && b.IsBoolFlag()
	}
	var positional []string
	for i := 0; i < len(args); i++ {
		a := args[i]
		if a == "--" {
			positional = append(positional, args[i+1:]...)
			break
		}
		if len(a) < 2 || a[0] != '-' {
			if i > 0 && (a == "true" || a == "false") {
				if prev := strings.TrimLeft(args[i-1], "-"); fs.Lookup(prev) != nil && isBool(prev) {
					return nil, "", nil, fmt.Errorf("%s %s: a true/false flag takes its value after '=': %s=%s", args[i-1], a, args[i-1], a)
				}
			}
			positional = append(positional, a)
			continue
		}
		name, val, hasVal := strings.Cut(strings.TrimPrefix(a[1:], "-"), "=")
		// next takes the argument after a flag as its value.
		next := func() (string, error) {
			if i+1 >= len(args) {
				return "", fmt.Errorf("flag needs an argument: %s", a)
			}
			i++
			return args[i], nil
		}
		al, ok := serveAliases[name]
		if !ok {
			if fs.Lookup(name) == nil && name != "h" && name != "help" {
				// Said here, before a value after it could be taken for the model.
				return nil, "", nil, fmt.Errorf("flag provided but not defined: %s (shoal serve -h lists them)", a)
			}
			out = append(out, a)
			if fs.Lookup(name) != nil && !hasVal && !isBool(name) && i+1 < len(args) {
				i++
				out = append(out, args[i])
			}
			continue
		}
		if al.flag == "" { // accepted without effect
			ignored = append(ignored, a)
			if al.takesValue && !hasVal {
				if _, err := next(); err != nil {
					return nil, "", nil, err
				}
			}
			continue
		}
		switch {
		case al.set != "" && !al.optional:
			if hasVal {
				return nil, "", nil, fmt.Errorf("%s takes no value", a)
			}
			val = al.set
		case isBool(al.flag) && !hasVal:
			val = "true"
		case !hasVal && al.optional && (i+1 >= len(args) || !slices.Contains(optionalValues, args[i+1])):
			val = al.set // the next argument is no value of it (a flag, the model)
		case !hasVal:
			if val, err = next(); err != nil {
				return nil, "", nil, err
			}
		}
		if al.value != nil {
			if val, err = al.value(val); err != nil {
				return nil, "", nil, err
			}
		}
		if name == "served-model-name" && !hasVal {
			// vLLM reads every argument up to the next flag as another name
			// (here, up to a model file too).
			for i+1 < len(args) && !strings.HasPrefix(args[i+1], "-") && !isModelFile(args[i+1]) {
				i++
				val += "," + args[i]
			}
		}
		out = append(out, "--"+al.flag+"="+val)
	}
	switch len(positional) {
	case 0:
	case 1:
		model = positional[0]
	default:
		return nil, "", nil, fmt.Errorf("unexpected arguments: %v (the model is one argument, or --model)", positional)
	}
	return out, model, ignored, nil
}

// aliasHelp lists the aliases for serve's help, by whose spelling they are.
func aliasHelp() string {
	var b strings.Builder
	for _, from := range []string{fromLlama, fromVLLM} {
		var names []string
		for name, al := range serveAliases {
			if al.from == from {
				names = append(names, name)
			}
		}
		slices.Sort(names)
		fmt.Fprintf(&b, "\n%s's spellings:\n", from)
		for _, name := range names {
			al := serveAliases[name]
			what := "accepted without effect"
			if al.flag != "" {
				what = "--" + al.flag
				if al.set != "" && !al.optional {
					what += "=" + al.set
				}
			}
			if al.note != "" {
				what += " (" + al.note + ")"
			}
			dash := "--"
			if len(name) <= 3 {
				dash = "-"
			}
			fmt.Fprintf(&b, "  %-28s %s\n", dash+name, what)
		}
	}
	return b.String()
}
