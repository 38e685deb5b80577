package engine

import (
	"encoding/json"
	"fmt"
	"regexp"
	"slices"
	"strings"
)

// Limits on what llama.cpp's schema converter is given: it recurses in C++,
// where running out of stack kills the process, once per character of a
// property name (through std::regex), once per $ref it follows under allOf
// (without end on a cycle) and once per level of a pattern's groups.
const (
	maxSchemaName = 1024 // bytes of a property name, a $defs name or a $ref
	maxRefChain   = 64   // $refs (and allOf components) followed one into another
	maxGroupDepth = 32   // nested groups of a pattern
	// The converter lays out an object's optional properties in time that
	// grows with the cube of their number (every suffix of them, copied at
	// every level of a recursion): 250 took 81 ms, 500 0.86 s, 1,000 4.1 s
	// and 2,000 about a minute of a core, for one request. maxOptional bounds
	// one object's, optionalBudget the sum of their cubes over the schema.
	maxOptional    = 256
	optionalBudget = 2 * maxOptional * maxOptional * maxOptional
)

// maxProperties bounds an object's properties, maxAlikeNames those of them
// whose rule names come out alike (the converter's time grows with their
// square: 8,000 such took it 5.8 s).
const (
	maxProperties = 4096
	maxAlikeNames = 256
)

// ruleNameRE is what the converter replaces in a name to make a rule's.
var ruleNameRE = regexp.MustCompile(`[^a-zA-Z0-9-]+`)

// maxSchemaAlternatives bounds the enum values and anyOf and oneOf branches of
// a schema, in all: each is an alternative of the grammar (MaxAlternatives).
const maxSchemaAlternatives = MaxAlternatives

// CheckSchema refuses a JSON schema llama.cpp's converter would crash on: a
// name longer than maxSchemaName, a $ref cycle through allOf or aliases, a
// chain of them deeper than maxRefChain. Recursion through properties or
// items (a tree) is fine: the converter refers to a rule there. It also
// refuses a schema, or one within it, whose lower bound passes its upper: no
// value matches it, and the grammar llama.cpp makes of minLength above
// maxLength never stops growing. And it refuses objects with more optional
// properties than the converter lays out in a fraction of a second
// (maxOptional, optionalBudget), and more than maxSchemaAlternatives enum
// values and branches.
func CheckSchema(schema []byte) error {
	var root any
	if err := json.Unmarshal(schema, &root); err != nil {
		return nil // the converter refuses it itself
	}
	bad := func(format string, args ...any) error {
		return fmt.Errorf("json schema: "+format+": %w", append(args, ErrInvalidInput)...)
	}
	resolve := func(ref string) (any, bool) {
		if ref == "#" {
			return root, true
		}
		for _, prefix := range []string{"#/$defs/", "#/definitions/"} {
			if name, ok := strings.CutPrefix(ref, prefix); ok {
				defs, _ := root.(map[string]any)[strings.TrimSuffix(strings.TrimPrefix(prefix, "#/"), "/")].(map[string]any)
				v, ok := defs[name]
				return v, ok
			}
		}
		return nil, false
	}
	// follow walks what the converter follows one into another from v: its
	// $ref, and its allOf's components.
	var follow func(v any, depth int, seen map[string]bool) error
	follow = func(v any, depth int, seen map[string]bool) error {
		m, ok := v.(map[string]any)
		if !ok {
			return nil
		}
		if depth > maxRefChain {
			return bad("$refs and allOf followed more than %d deep", maxRefChain)
		}
		if ref, ok := m["$ref"].(string); ok {
			if seen[ref] {
				return bad("the $ref %.64q refers back to itself through $refs or allOf", ref)
			}
			if target, ok := resolve(ref); ok {
				seen[ref] = true
				err := follow(target, depth+1, seen)
				delete(seen, ref)
				if err != nil {
					return err
				}
			}
		}
		all, _ := m["allOf"].([]any)
		for _, c := range all {
			if err := follow(c, depth+1, seen); err != nil {
				return err
			}
		}
		return nil
	}
	// optional counts an object schema's optional properties as the converter
	// lays them out. An object with properties (or additionalProperties other
	// than true), which the converter takes first, whatever allOf it has: its
	// properties not required (and "additionalProperties", one more). Else one
	// with allOf: the converter merges the properties of its components ($refs
	// followed), a component's as required, those of the branches of a
	// component's anyOf as optional.
	optional := func(m map[string]any) int {
		_, hasProps := m["properties"]
		extra, hasExtra := m["additionalProperties"]
		all, ok := m["allOf"].([]any)
		if !ok || hasProps || hasExtra && extra != true {
			props, _ := m["properties"].(map[string]any)
			req, _ := m["required"].([]any)
			n := len(props)
			for _, r := range req {
				if name, ok := r.(string); ok && props[name] != nil {
					n--
				}
			}
			if _, obj := m["additionalProperties"].(map[string]any); obj || m["additionalProperties"] == true {
				n++
			}
			return n
		}
		n := 0
		var component func(c any, required bool, depth int)
		component = func(c any, required bool, depth int) {
			cm, _ := c.(map[string]any)
			if ref, ok := cm["$ref"].(string); ok && depth < maxRefChain {
				t, _ := resolve(ref)
				component(t, required, depth+1)
				return
			}
			if props, ok := cm["properties"].(map[string]any); ok && !required {
				n += len(props)
			}
		}
		for _, t := range all {
			tm, _ := t.(map[string]any)
			if branches, ok := tm["anyOf"].([]any); ok {
				for _, b := range branches {
					component(b, false, 0)
				}
			} else {
				component(t, true, 0)
			}
		}
		return n
	}
	cubes, alternatives := 0, 0
	var walk func(v any) error
	walk = func(v any) error {
		switch v := v.(type) {
		case map[string]any:
			for _, k := range []string{"enum", "anyOf", "oneOf"} {
				list, _ := v[k].([]any)
				if alternatives += len(list); alternatives > maxSchemaAlternatives {
					return bad("more than %d enum values and anyOf and oneOf branches in all", maxSchemaAlternatives)
				}
			}
			// The converter lays a schema out once per entry of its type list:
			// a repeated entry ("object", "object") doubles all below it, and
			// nested, that multiplies.
			if types, ok := v["type"].([]any); ok {
				seen := map[string]bool{}
				for _, t := range types {
					if name, ok := t.(string); ok {
						if seen[name] {
							return bad("a type list names %s twice", name)
						}
						seen[name] = true
					}
				}
			}
			if props, ok := v["properties"].(map[string]any); ok {
				if len(props) > maxProperties {
					return bad("an object with %d properties (at most %d)", len(props), maxProperties)
				}
				// The converter names a property's rules by its name with
				// every run of other characters than letters, digits and -
				// made one -, and looks through the names it has for each
				// new one: names that come out alike cost it more each.
				alike := map[string]int{}
				same := 0
				for name := range props {
					r := ruleNameRE.ReplaceAllString(name, "-")
					if alike[r]++; alike[r] > 1 {
						same++
					}
				}
				if same > maxAlikeNames {
					return bad("an object with %d property names that differ only in characters other than letters, digits and - (at most %d)", same, maxAlikeNames)
				}
			}
			if n := optional(v); n > maxOptional {
				return bad("an object with %d optional properties (at most %d): mark more of them required, or nest them", n, maxOptional)
			} else if cubes += n * n * n; cubes > optionalBudget {
				return bad("objects with too many optional properties in all (at most %d in one; the grammar's construction grows with the cube of their number)", maxOptional)
			}
			for k, x := range v {
				if len(k) > maxSchemaName {
					return bad("a name of %d bytes (at most %d)", len(k), maxSchemaName)
				}
				if s, ok := x.(string); ok && k == "$ref" && len(s) > maxSchemaName {
					return bad("a $ref of %d bytes (at most %d)", len(s), maxSchemaName)
				} else if ok && k == "$ref" && !strings.HasPrefix(s, "#") {
					// The converter fetches nothing: a remote one would match
					// anything, unsaid.
					return bad("$ref %.64q: only references within the schema (#/$defs/..., #/definitions/...) are followed", s)
				}
				if err := walk(x); err != nil {
					return err
				}
			}
			_, hasRef := v["$ref"]
			_, hasAll := v["allOf"]
			if hasRef || hasAll {
				return follow(v, 0, map[string]bool{})
			}
		case []any:
			for _, x := range v {
				if err := walk(x); err != nil {
					return err
				}
			}
		}
		return nil
	}
	if err := walk(root); err != nil {
		return err
	}
	if err := checkBounds(root, false); err != nil {
		return bad("%v", err)
	}
	return nil
}

// boundPairs are a schema's lower and upper bounds, and whether equal ones
// leave no value (an exclusive bound).
var boundPairs = []struct {
	lo, hi string
	open   bool
}{
	{"minLength", "maxLength", false}, {"minItems", "maxItems", false}, {"minProperties", "maxProperties", false},
	{"minimum", "maximum", false}, {"exclusiveMinimum", "exclusiveMaximum", true},
	{"minimum", "exclusiveMaximum", true}, {"exclusiveMinimum", "maximum", true},
}

// checkBounds refuses v, or a schema within it, whose bounds no value meets.
// names says v maps names to schemas (properties, $defs): its keys are names,
// not keywords.
func checkBounds(v any, names bool) error {
	switch v := v.(type) {
	case map[string]any:
		if !names {
			for _, b := range boundPairs {
				lo, ok1 := v[b.lo].(float64)
				hi, ok2 := v[b.hi].(float64)
				if ok1 && ok2 && (lo > hi || b.open && lo == hi) {
					return fmt.Errorf("%s %v and %s %v: no value is within them", b.lo, lo, b.hi, hi)
				}
			}
		}
		for k, x := range v {
			if !names && slices.Contains(skippedKeys, k) {
				continue // values, not schemas
			}
			if err := checkBounds(x, !names && slices.Contains(nameMaps, k)); err != nil {
				return err
			}
		}
	case []any:
		for _, x := range v {
			if err := checkBounds(x, false); err != nil {
				return err
			}
		}
	}
	return nil
}
