// Package purity holds the tests that keep a pure core pure: a package whose
// only dependencies are an allowlist of standard-library (or named sibling)
// packages, and which starts no goroutines. The pools call it from their
// tests; it is imported by tests only.
package purity

import (
	"go/ast"
	"go/parser"
	"go/token"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"
)

// Forbidden may not appear among a pure package's dependencies, even
// transitively: network, processes, plugins, cgo, logging, contexts, crypto.
var Forbidden = []string{"net", "os/exec", "os/signal", "plugin", "runtime/cgo", "log", "context", "crypto"}

// CheckDeps fails t when the package in the current directory imports
// anything not in allowed, depends (transitively) on a non-standard package
// that is not in allowed, or depends on anything in Forbidden.
func CheckDeps(t testing.TB, allowed map[string]bool) {
	t.Helper()
	goTool, err := exec.LookPath("go")
	if err != nil {
		t.Skip("go tool not on PATH: cannot list dependencies")
	}
	out, err := exec.Command(goTool, "list", "-f", `{{join .Imports "\n"}}`, ".").Output()
	require.NoError(t, err)
	for _, imp := range strings.Fields(string(out)) {
		require.True(t, allowed[imp], "forbidden direct import %q", imp)
	}
	out, err = exec.Command(goTool, "list", "-deps", "-f", `{{.ImportPath}} {{.Standard}}`, ".").Output()
	require.NoError(t, err)
	lines := strings.Split(strings.TrimSpace(string(out)), "\n")
	self := strings.Fields(lines[len(lines)-1])[0] // -deps lists the package itself last
	for _, line := range lines {
		f := strings.Fields(line)
		require.Len(t, f, 2, "go list line %q", line)
		path, std := f[0], f[1] == "true"
		require.True(t, std || path == self || allowed[path], "non-standard dependency %q", path)
		for _, bad := range Forbidden {
			require.False(t, path == bad || strings.HasPrefix(path, bad+"/"), "forbidden dependency %q", path)
		}
	}
}

// CheckNoGoroutines fails t when a non-test file of the package in the
// current directory has a go statement: a pure core leaves concurrency to
// its caller.
func CheckNoGoroutines(t testing.TB) {
	t.Helper()
	files, err := filepath.Glob("*.go")
	require.NoError(t, err)
	fset := token.NewFileSet()
	checked := 0
	for _, name := range files {
		if strings.HasSuffix(name, "_test.go") {
			continue
		}
		f, err := parser.ParseFile(fset, name, nil, 0)
		require.NoError(t, err)
		ast.Inspect(f, func(n ast.Node) bool {
			if g, ok := n.(*ast.GoStmt); ok {
				t.Errorf("%s: go statement in a pure package", fset.Position(g.Pos()))
			}
			return true
		})
		checked++
	}
	require.Positive(t, checked)
}
