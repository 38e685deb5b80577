// Command shoal serves GGUF language models on every machine it runs on and routes
// each request to the node that will answer it soonest.
//
// Only this package reads flags, environment variables and files; it turns them into
// the Config of each package, wires the packages together and runs them.
package main

import (
	"fmt"
	"io"
	"os"
)

// version is set at build time with -ldflags "-X main.version=...".
var version = "dev"

type command struct {
	name  string
	short string
	run   func(args []string, stdout, stderr io.Writer) error
}

func commands() []command {
	return []command{
		{"serve", "serve a GGUF model with an OpenAI-compatible HTTP API", runServe},
		{"status", "print the cluster's nodes, their load and cache as a table", runStatus},
		{"bench", "load-test an OpenAI-compatible endpoint (random or shared-prefix prompts)", runBench},
		{"version", "print shoal's version, the llama.cpp commit and the CPU features of its kernels", runVersion},
		{"calibrate", "measure the engine on this machine and write a profile for simulated nodes (serve --sim)", runCalibrate},
		{"gen-model", "write a generated llama-architecture test model (random weights) to a GGUF file", runGenModel},
		{"quantize", "write a copy of a GGUF model with quantized weights (q8_0, q4_k_m, ...), as llama-quantize does", runQuantize},
	}
}

func usage(w io.Writer) {
	fmt.Fprintf(w, "shoal %s: serve GGUF language models on a cluster of machines\n\nUsage: shoal <command> [flags]\n\nCommands:\n", version)
	for _, c := range commands() {
		fmt.Fprintf(w, "  %-10s %s\n", c.name, c.short)
	}
	fmt.Fprintf(w, "\nRun 'shoal <command> --help' for a command's flags.\n")
}

func main() {
	os.Exit(run(os.Args[1:], os.Stdout, os.Stderr))
}

func run(args []string, stdout, stderr io.Writer) int {
	if len(args) == 0 {
		usage(stderr) // a command is needed: as for an unknown one
		return 2
	}
	if args[0] == "help" || args[0] == "-h" || args[0] == "--help" {
		usage(stdout)
		return 0
	}
	for _, c := range commands() {
		if c.name == args[0] {
			if err := c.run(args[1:], stdout, stderr); err != nil {
				if err == errHelp {
					return 0
				}
				fmt.Fprintf(stderr, "shoal %s: %v\n", c.name, err)
				return 1
			}
			return 0
		}
	}
	fmt.Fprintf(stderr, "shoal: unknown command %q\n\n", args[0])
	usage(stderr)
	return 2
}
