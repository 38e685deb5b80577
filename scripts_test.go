package shoal

import (
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
)

// TestBuildCUDANamesWhatToInstall runs scripts/build-cuda.sh (make build GPU=cuda) on a
// PATH that lacks CMake, carries an old one, lacks nvcc, then is given a directory
// without the ollama sources: each time it must stop with exit status 1 and say what
// to install or pass, before it builds anything.
func TestBuildCUDANamesWhatToInstall(t *testing.T) {
	for _, d := range []string{os.Getenv("CUDA_HOME"), os.Getenv("CUDA_PATH"), "/usr/local/cuda"} {
		if d != "" {
			if _, err := os.Stat(filepath.Join(d, "bin", "nvcc")); err == nil {
				t.Skipf("nvcc found outside PATH at %s: the script would find it", d)
			}
		}
	}
	bash, err := exec.LookPath("bash")
	if err != nil {
		t.Skip("no bash")
	}
	// A PATH of only the tools the script's checks use; each case puts its fakes ahead.
	bin := t.TempDir()
	for _, tool := range []string{"dirname", "awk", "sort", "head"} {
		p, err := exec.LookPath(tool)
		if err != nil {
			t.Skipf("no %s", tool)
		}
		if err := os.Symlink(p, filepath.Join(bin, tool)); err != nil {
			t.Fatal(err)
		}
	}
	for _, c := range []struct {
		cmake string // version of the fake cmake; "" for none
		nvcc  bool   // a fake nvcc on PATH
		want  []string
	}{
		{"", false, []string{"CMake is not installed", "apt-get install cmake"}},
		{"3.16.3", false, []string{"CMake 3.16.3 is too old", "3.21"}},
		{"3.28.3", false, []string{"nvcc", "not installed", "CUDA toolkit 11.8 or later", "CUDA_HOME"}},
		{"3.28.3", true, []string{"does not hold the ollama sources"}},
	} {
		fakes := t.TempDir() // this case's fake cmake and nvcc, ahead of the tools
		fake := func(name, body string) {
			if err := os.WriteFile(filepath.Join(fakes, name), []byte("#!"+bash+"\n"+body+"\n"), 0o755); err != nil {
				t.Fatal(err)
			}
		}
		if c.cmake != "" {
			fake("cmake", "echo 'cmake version "+c.cmake+"'")
		}
		if c.nvcc {
			fake("nvcc", "exit 0")
		}
		cmd := exec.Command(bash, "scripts/build-cuda.sh", t.TempDir(), filepath.Join(t.TempDir(), "lib"))
		cmd.Env = []string{"PATH=" + fakes + ":" + bin, "BUILD_DIR=" + filepath.Join(t.TempDir(), "cuda")}
		raw, err := cmd.CombinedOutput()
		out := string(raw)
		if ee, ok := err.(*exec.ExitError); !ok || ee.ExitCode() != 1 {
			t.Fatalf("cmake %q, nvcc %v: build-cuda.sh: %v, want exit status 1; output:\n%s", c.cmake, c.nvcc, err, out)
		}
		for _, w := range c.want {
			if !strings.Contains(out, w) {
				t.Errorf("cmake %q, nvcc %v: output lacks %q:\n%s", c.cmake, c.nvcc, w, out)
			}
		}
	}
}
