package main

import (
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"os"
	"runtime"

	"github.com/shoal-ai/shoal/engine"
	"github.com/shoal-ai/shoal/engine/llama"
)

// errHelp is returned by a command that printed its help on request.
var errHelp = errors.New("help requested")

// newFlags makes a FlagSet whose -h prints to stdout and stops the command quietly.
func newFlags(name string, stdout io.Writer) *flag.FlagSet {
	fs := flag.NewFlagSet("shoal "+name, flag.ContinueOnError)
	fs.SetOutput(stdout)
	return fs
}

// parse parses args into fs: -h prints the help; a bad flag or value is an
// error of one line (the flag package would print the whole help after it).
func parse(fs *flag.FlagSet, args []string) error {
	out, usage := fs.Output(), fs.Usage
	fs.SetOutput(io.Discard)
	fs.Usage = func() {}
	err := fs.Parse(args)
	fs.SetOutput(out)
	fs.Usage = usage
	if err != nil {
		if errors.Is(err, flag.ErrHelp) {
			fs.Usage()
			return errHelp
		}
		return fmt.Errorf("%w (%s -h lists the flags)", err, fs.Name())
	}
	if fs.NArg() > 0 {
		return fmt.Errorf("unexpected arguments: %v", fs.Args())
	}
	return nil
}

// intFlag is an integer flag's name, value and least value.
type intFlag struct {
	name   string
	v, min int
}

// atLeast says the first of flags below its least value, naming it.
func atLeast(flags ...intFlag) error {
	for _, f := range flags {
		if f.v < f.min {
			return fmt.Errorf("--%s %d: must be at least %d", f.name, f.v, f.min)
		}
	}
	return nil
}

func runVersion(args []string, stdout, _ io.Writer) error {
	fs := newFlags("version", stdout)
	if err := parse(fs, args); err != nil {
		return err
	}
	fmt.Fprintf(stdout, "shoal %s\nllama.cpp %s\ncpu kernels: %s\ngo %s %s/%s\n",
		version, llama.LlamaCommit(), llama.CPUFeatures(), runtime.Version(), runtime.GOOS, runtime.GOARCH)
	// Devices: the CPU, and a GPU for each backend library found in <exe>/../lib/ollama
	// (ollama's loader logs what it loaded at info level; only its warnings here).
	slog.SetDefault(slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelWarn})))
	for _, d := range llama.Devices() {
		fmt.Fprintf(stdout, "device %s: %s (%s, %s total, %s free)\n", d.Name, d.Description, d.Kind, engine.FormatBytes(d.MemoryTotal), engine.FormatBytes(d.MemoryFree))
	}
	return nil
}
