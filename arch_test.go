package shoal

import (
	"encoding/json"
	"os/exec"
	"strings"
	"testing"
)

const module = "github.com/shoal-ai/shoal"

// allowed is DESIGN.md's table of which project packages may import which.
// engine/sample is part of the engine layer: plain Go that may go wherever engine goes.
var allowed = map[string][]string{
	"engine":            {},
	"engine/sample":     {"engine"},
	"engine/enginetest": {"engine"},
	"engine/llama":      {"engine"},
	"engine/sim":        {"engine"},
	"kvcache":           {},
	"scheduler":         {"engine", "engine/sample", "kvcache"},
	"cluster":           {"kvcache"},
	"api":               {"scheduler", "cluster", "models", "engine", "engine/sample"},
	"models":            {},
	"cmd/shoal":         {"*"},
	"":                  {},
	"tools":             {},
	"scripts/plotbench": {},
}

// cgoFree must never link llama.cpp, so that `go test -race` of them stays quick.
var cgoFree = []string{"engine", "engine/sample", "engine/enginetest", "engine/sim", "kvcache", "scheduler", "cluster", "api", "models"}

type pkg struct {
	ImportPath string
	Imports    []string
	Deps       []string
	CgoFiles   []string
}

func listPackages(t *testing.T) []pkg {
	t.Helper()
	out, err := exec.Command("go", "list", "-json", "./...").Output()
	if err != nil {
		t.Fatalf("go list: %v", err)
	}
	var ps []pkg
	dec := json.NewDecoder(strings.NewReader(string(out)))
	for dec.More() {
		var p pkg
		if err := dec.Decode(&p); err != nil {
			t.Fatal(err)
		}
		ps = append(ps, p)
	}
	return ps
}

func rel(path string) (string, bool) {
	if path == module {
		return "", true
	}
	r, ok := strings.CutPrefix(path, module+"/")
	return r, ok
}

func TestImportDirections(t *testing.T) {
	for _, p := range listPackages(t) {
		name, _ := rel(p.ImportPath)
		rules, ok := allowed[name]
		if !ok {
			t.Errorf("package %q is not in DESIGN's table (arch_test.go allowed)", name)
			continue
		}
		if len(rules) == 1 && rules[0] == "*" {
			continue
		}
		for _, imp := range p.Imports {
			dep, ours := rel(imp)
			if !ours {
				continue
			}
			okImp := false
			for _, a := range rules {
				okImp = okImp || a == dep
			}
			if !okImp {
				t.Errorf("%s imports %s, which DESIGN does not allow", name, dep)
			}
		}
		if len(p.CgoFiles) > 0 && name != "engine/llama" {
			t.Errorf("%s has cgo files; only engine/llama may", name)
		}
	}
}

func TestPurePackagesDoNotLinkLlama(t *testing.T) {
	for _, p := range listPackages(t) {
		name, _ := rel(p.ImportPath)
		for _, free := range cgoFree {
			if name != free {
				continue
			}
			for _, d := range p.Deps {
				if strings.HasPrefix(d, "github.com/ollama/ollama/llama") || d == module+"/engine/llama" {
					t.Errorf("%s depends on %s and would compile llama.cpp", name, d)
				}
			}
		}
	}
}
