package k8s

import (
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"
)

// FuzzDecodeStrict feeds arbitrary documents to the strict decoder, seeded
// with every manifest in the tree: it must never panic, and what it accepts
// has a kind and a name.
func FuzzDecodeStrict(f *testing.F) {
	_ = filepath.WalkDir(".", func(path string, d os.DirEntry, err error) error {
		if err != nil || d.IsDir() || !strings.HasSuffix(path, ".yaml") || d.Name() == "kustomization.yaml" {
			return nil
		}
		raw, err := os.ReadFile(path)
		if err == nil {
			for _, doc := range strings.Split(string(raw), "\n---\n") {
				f.Add([]byte(doc))
			}
		}
		return nil
	})
	f.Add([]byte("apiVersion: leaderworkerset.x-k8s.io/v1\nkind: LeaderWorkerSet\nmetadata: {name: x}\nspec: {leaderWorkerTemplate: {workerTemplate: {}}}\n"))
	f.Fuzz(func(t *testing.T, doc []byte) {
		o, err := decodeStrict(doc)
		if err != nil {
			return
		}
		require.NotEmpty(t, o.Kind)
		require.NotEmpty(t, o.Name)
		require.NotNil(t, o.Obj)
	})
}

// FuzzExpand checks the kubelet-style expansion: no panic, text without "$"
// is unchanged, and a defined variable reference is always replaced.
func FuzzExpand(f *testing.F) {
	for _, s := range []string{"$(A)", "$$(A)", "x$(B)y", "$(", "$()", "plain", "$(A)$(A)"} {
		f.Add(s)
	}
	env := map[string]string{"A": "1", "B": "two"}
	f.Fuzz(func(t *testing.T, s string) {
		out := expand(s, env)
		if !strings.Contains(s, "$") {
			require.Equal(t, s, out)
		}
		if s == "$(A)" {
			require.Equal(t, "1", out)
		}
	})
}
