//go:build tools

// Package tools pins modules that the build needs but no Go code imports: malgo ships
// the miniaudio.h header that llama.cpp's multimodal helper includes. It is never compiled.
package tools

import _ "github.com/gen2brain/malgo"
