package shoal

import (
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
)

// writeFake writes an executable bash script called name into dir: a stand-in for a
// tool the script under test runs.
func writeFake(t *testing.T, bash, dir, name, body string) {
	t.Helper()
	if err := os.WriteFile(filepath.Join(dir, name), []byte("#!"+bash+"\n"+body+"\n"), 0o755); err != nil {
		t.Fatal(err)
	}
}

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
		if c.cmake != "" {
			writeFake(t, bash, fakes, "cmake", "echo 'cmake version "+c.cmake+"'")
		}
		if c.nvcc {
			writeFake(t, bash, fakes, "nvcc", "exit 0")
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

// TestBuildCUDACopiesRuntimeLibraries runs scripts/build-cuda.sh with a fake CMake and
// nvcc on a toolkit whose libraries lie outside the loader's path (as pip's nvidia-*
// packages keep them, apart from nvcc): the script must configure without Vulkan
// and HIP for the architectures asked, and install beside the backend the CUDA
// libraries it needs, those the first ones need in turn (cuBLAS needs cuBLASLt)
// included, found where CMake linked them, so that ldd resolves all of them.
func TestBuildCUDACopiesRuntimeLibraries(t *testing.T) {
	bash, err := exec.LookPath("bash")
	if err != nil {
		t.Skip("no bash")
	}
	gcc, err := exec.LookPath("gcc")
	if err != nil {
		t.Skip("no gcc to build the fake libraries")
	}
	if _, err := exec.LookPath("ldd"); err != nil {
		t.Skip("no ldd")
	}
	dir := t.TempDir()
	toolkit := filepath.Join(dir, "site-packages", "nvidia", "cu13", "lib")
	built := filepath.Join(dir, "built") // what the fake CMake's build step leaves
	src := filepath.Join(dir, "src")
	fakes := filepath.Join(dir, "fakes")
	for _, d := range []string{toolkit, built, filepath.Join(src, "ml/backend/ggml/ggml/src/ggml-cuda"), fakes} {
		if err := os.MkdirAll(d, 0o755); err != nil {
			t.Fatal(err)
		}
	}
	// The function build-cuda.sh patches, as the pinned sources have it.
	cu := filepath.Join("ml/backend/ggml/ggml/src/ggml-cuda", "ggml-cuda.cu")
	free := "static void ggml_backend_cuda_free(ggml_backend_t backend) {\n" +
		"    ggml_backend_cuda_context * cuda_ctx = (ggml_backend_cuda_context *)backend->context;\n\n" +
		"    delete cuda_ctx;\n    delete backend;\n}\n"
	for name, body := range map[string]string{"CMakeLists.txt": "", "CMakePresets.json": "{}", cu: free} {
		if err := os.WriteFile(filepath.Join(src, name), []byte(body), 0o444); err != nil {
			t.Fatal(err)
		}
	}
	cfile := filepath.Join(dir, "f.c")
	if err := os.WriteFile(cfile, []byte("int f(void) { return 0; }\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	// libggml-cuda.so needs libcudart.so.13 and libcublas.so.13; libcublas.so.13
	// needs libcublasLt.so.13 and finds it beside itself.
	for _, l := range []struct {
		out  string
		deps []string
	}{
		{filepath.Join(toolkit, "libcublasLt.so.13"), nil},
		{filepath.Join(toolkit, "libcudart.so.13"), nil},
		{filepath.Join(toolkit, "libcublas.so.13"), []string{"libcublasLt.so.13"}},
		{filepath.Join(built, "libggml-cuda.so"), []string{"libcudart.so.13", "libcublas.so.13"}},
	} {
		args := []string{"-shared", "-fPIC", "-o", l.out, "-Wl,-soname," + filepath.Base(l.out), cfile, "-Wl,-rpath,$ORIGIN", "-Wl,--no-as-needed"}
		for _, d := range l.deps {
			args = append(args, filepath.Join(toolkit, d))
		}
		if out, err := exec.Command(gcc, args...).CombinedOutput(); err != nil {
			t.Fatalf("gcc %s: %v\n%s", filepath.Base(l.out), err, out)
		}
	}
	if err := os.WriteFile(filepath.Join(built, "libggml-base.so"), nil, 0o644); err != nil {
		t.Fatal(err)
	}
	args := filepath.Join(dir, "cmake-args")
	writeFake(t, bash, fakes, "nvcc", "echo 'Cuda compilation tools, release 13.0, V13.0.88'")
	writeFake(t, bash, fakes, "cmake", `case "$1" in
--version) echo 'cmake version 3.28.3' ;;
-S)
	echo "$@" >`+args+`
	while [ "$1" != -B ]; do shift; done
	mkdir -p "$2"
	echo 'CUDA_cudart_LIBRARY:FILEPATH=`+toolkit+`/libcudart.so' >"$2/CMakeCache.txt"
	echo 'CUDA_cublas_LIBRARY:FILEPATH=`+toolkit+`/libcublas.so' >>"$2/CMakeCache.txt" ;;
--build) mkdir -p "$2/lib/ollama" && cp `+built+`/* "$2/lib/ollama/" ;;
esac`)
	dest := filepath.Join(dir, "lib", "ollama")
	cmd := exec.Command(bash, "scripts/build-cuda.sh", src, dest)
	cmd.Env = append(os.Environ(), "PATH="+fakes+":"+os.Getenv("PATH"), "CUDA_ARCHS=90", "BUILD_DIR="+filepath.Join(dir, "build", "cuda"))
	out, err := cmd.CombinedOutput()
	if err != nil {
		t.Fatalf("build-cuda.sh: %v\n%s", err, out)
	}
	if strings.Contains(string(out), "still lacks") {
		t.Errorf("build-cuda.sh warns of missing libraries:\n%s", out)
	}
	for _, l := range []string{"libggml-base.so", "libggml-cuda.so", "libcudart.so.13", "libcublas.so.13", "libcublasLt.so.13"} {
		if _, err := os.Stat(filepath.Join(dest, l)); err != nil {
			t.Errorf("%s not installed: %v\n%s", l, err, out)
		}
	}
	ldd, err := exec.Command("ldd", filepath.Join(dest, "libggml-cuda.so")).CombinedOutput()
	if err != nil || strings.Contains(string(ldd), "not found") {
		t.Errorf("ldd of the installed backend: %v\n%s", err, ldd)
	}
	configured, err := os.ReadFile(args)
	if err != nil {
		t.Fatal(err)
	}
	// CMake builds a patched copy: the CUDA backend's free keeps its handle, without
	// reset, for ggml_backend_sched_free; the sources themselves are left alone.
	copied := filepath.Join(dir, "build", "cuda.src")
	if !strings.Contains(string(configured), "-S "+copied+" ") {
		t.Errorf("cmake configured from elsewhere than the patched copy %s: %s", copied, configured)
	}
	patched, err := os.ReadFile(filepath.Join(copied, cu))
	if err != nil {
		t.Fatal(err)
	}
	if p := string(patched); strings.Contains(p, "delete backend;") || !strings.Contains(p, "backend->iface.reset = nullptr;") {
		t.Errorf("ggml_backend_cuda_free not patched:\n%s", p)
	}
	if orig, _ := os.ReadFile(filepath.Join(src, cu)); string(orig) != free {
		t.Errorf("the sources were changed:\n%s", orig)
	}
	// Building again reuses the patched copy.
	again := exec.Command(bash, "scripts/build-cuda.sh", src, dest)
	again.Env = cmd.Env
	if out, err := again.CombinedOutput(); err != nil {
		t.Errorf("build-cuda.sh a second time: %v\n%s", err, out)
	}
	for _, w := range []string{"-DCMAKE_CUDA_ARCHITECTURES=90", "-DCMAKE_DISABLE_FIND_PACKAGE_Vulkan=ON", "-DCMAKE_HIP_COMPILER=OFF", "-DCMAKE_CUDA_COMPILER=" + filepath.Join(fakes, "nvcc")} {
		if !strings.Contains(string(configured), w) {
			t.Errorf("cmake configured without %s: %s", w, configured)
		}
	}
}
