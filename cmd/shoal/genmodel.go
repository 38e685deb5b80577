package main

import (
	"errors"
	"flag"
	"fmt"
	"io"
	"slices"
	"strings"

	"github.com/shoal-ai/shoal/models"
)

func runGenModel(args []string, stdout, _ io.Writer) error {
	fs := newFlags("gen-model", stdout)
	names := slices.Sorted(func(yield func(string) bool) {
		for k := range models.Presets {
			if !yield(k) {
				return
			}
		}
	})
	preset := fs.String("preset", "tiny", "model size: "+strings.Join(names, ", "))
	out := fs.String("out", "", "output GGUF path (required)")
	seed := fs.Uint64("seed", 0, "weight seed (0: the preset's)")
	tools := fs.String("tools", "", "write a chat template that shows tools in a model's own call format: hermes (Hermes/Qwen <tool_call> tags), qwen3-coder (Qwen3-Coder/Qwen 3.5 XML calls), llama3 (Llama 3's bare JSON calls), glm (GLM 4.5-4.7's <arg_key>/<arg_value> calls), mistral ([TOOL_CALLS]name[ARGS]{...}) or mistral-list ([TOOL_CALLS][{...}]); default: plain ChatML")
	fim := fs.Bool("fim", false, "add Qwen2.5-Coder's fill-in-the-middle control tokens (<|fim_prefix|>, <|fim_suffix|>, <|fim_middle|>, ...): the model serves /infill and suffix")
	lora := fs.Int("lora", 0, "write a LoRA adapter of this rank for the preset's model (with --seed, that model's seed) instead of a model: updates of every layer's attention query and value, for --lora on serve")
	reranker := fs.Bool("reranker", false, "write a reranker laid out as Qwen3-Reranker's GGUF (Qwen 3's architecture, rank pooling, a yes/no head, a rerank prompt): serve it with --reranking")
	mmproj := fs.Bool("mmproj", false, "write a multimodal projector for the preset's model (with --seed, that model's seed) instead of a model, laid out as LLaVA's (a 32×32 image becomes 16 tokens): for --mmproj on serve")
	imageSize := fs.Int("image-size", models.ProjectorImageSize, "with --mmproj: the side in pixels the projector scales an image to, a multiple of 8; an image becomes (side/8)² tokens (192: LLaVA 1.5's 576)")
	if err := parse(fs, args); err != nil {
		return err
	}
	mk, ok := models.Presets[*preset]
	if !ok {
		return fmt.Errorf("unknown preset %q (want one of %s)", *preset, strings.Join(names, ", "))
	}
	if *out == "" {
		return fmt.Errorf("--out is required")
	}
	given := false
	fs.Visit(func(f *flag.Flag) { given = given || f.Name == "image-size" })
	if given && !*mmproj {
		return fmt.Errorf("--image-size is the projector's: give it with --mmproj")
	}
	spec := mk()
	if *seed != 0 {
		spec.Seed = *seed
	}
	switch *tools {
	case "":
	case "hermes":
		spec.ChatTemplate = models.ToolsTemplate
	case "qwen3-coder":
		spec.ChatTemplate = models.QwenXMLToolsTemplate
	case "llama3":
		spec.ChatTemplate = models.Llama3ToolsTemplate
	case "glm":
		spec.ChatTemplate = models.GLMToolsTemplate
	case "mistral":
		spec.ChatTemplate, spec.ControlTokens = models.MistralToolsTemplate, models.MistralTokens
	case "mistral-list":
		spec.ChatTemplate, spec.ControlTokens = models.MistralListToolsTemplate, models.MistralTokens
	default:
		return fmt.Errorf("--tools %q: want hermes, qwen3-coder, llama3, glm, mistral or mistral-list", *tools)
	}
	if *fim {
		spec.ControlTokens = append(slices.Clip(spec.ControlTokens), models.FIMTokens...)
	}
	spec.Reranker = *reranker
	if *mmproj {
		if *reranker || *lora != 0 {
			return errors.New("--mmproj with --reranker or --lora: a projector is written for the llama-architecture models, alone")
		}
		if err := models.GenerateProjector(*out, spec, *imageSize); err != nil {
			return err
		}
		fmt.Fprintf(stdout, "wrote %s: a multimodal projector for %s\n", *out, spec.Name)
		return nil
	}
	if *lora != 0 {
		if err := models.GenerateLoRA(*out, spec, *lora, 0); err != nil {
			return err
		}
		fmt.Fprintf(stdout, "wrote %s: a rank-%d LoRA adapter for %s\n", *out, *lora, spec.Name)
		return nil
	}
	if err := models.Generate(*out, spec); err != nil {
		return err
	}
	fmt.Fprintf(stdout, "wrote %s: %s, %.1fM parameters\n", *out, spec.Name, float64(spec.Params())/1e6)
	return nil
}
