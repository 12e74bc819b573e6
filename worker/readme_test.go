package worker_test

import (
	"bytes"
	"context"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/perspectives-go/perspectives/internal/pgtest"
)

// readmeSection returns the README's section under heading, up to the next "## " heading.
func readmeSection(t *testing.T, readme, heading string) string {
	t.Helper()
	i := strings.Index(readme, "\n"+heading+"\n")
	require.GreaterOrEqual(t, i, 0, "README.md has no heading %q", heading)
	section := readme[i+len(heading)+2:]
	if j := strings.Index(section, "\n## "); j >= 0 {
		section = section[:j+1]
	}
	return section
}

// fenced returns the body of the first fenced block of lang in text, and the text after it.
func fenced(t *testing.T, text, lang string) (body, rest string) {
	t.Helper()
	open := "```" + lang + "\n"
	k := strings.Index(text, open)
	require.GreaterOrEqual(t, k, 0, "no ```%s block", lang)
	body = text[k+len(open):]
	end := strings.Index(body, "\n```")
	require.GreaterOrEqual(t, end, 0, "unterminated ```%s block", lang)
	return body[:end+1], body[end+len("\n```"):]
}

// TestReadmeQuickstartRunsVerbatim runs the README's quickstart program as it is written
// there, against a fresh, unmigrated database, and compares what it prints with the output the
// README shows after it.
func TestReadmeQuickstartRunsVerbatim(t *testing.T) {
	raw, err := os.ReadFile("../README.md")
	require.NoError(t, err)
	program, rest := fenced(t, readmeSection(t, string(raw), "## Quickstart"), "go")
	require.True(t, strings.HasPrefix(program, "package main\n"), "the quickstart is a complete program")
	want, _ := fenced(t, rest, "text")
	for _, step := range []string{"schema.Migrate(", "worker.New(", "worker.Append(", "worker.WaitFor(", "worker.LoadModel("} {
		require.Contains(t, program, step, "the quickstart shows every step")
	}

	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	d, err := pgtest.CreateEmpty(ctx, "readme")
	require.NoError(t, err)
	t.Cleanup(d.Close)

	dir := t.TempDir()
	main := filepath.Join(dir, "main.go")
	require.NoError(t, os.WriteFile(main, []byte(program), 0o644))
	goBin, err := exec.LookPath("go") // go test puts its own GOROOT/bin first on PATH
	require.NoError(t, err)
	cmd := exec.CommandContext(ctx, goBin, "run", main) // from this module, so its imports resolve here
	cmd.Dir = "."
	cmd.Env = append(os.Environ(), "DATABASE_URL="+d.DirectURL)
	var stdout, stderr bytes.Buffer
	cmd.Stdout, cmd.Stderr = &stdout, &stderr
	require.NoError(t, cmd.Run(), "go run the README's quickstart; stderr:\n%s", stderr.String())
	require.Equal(t, want, stdout.String(), "what the quickstart prints, as the README shows it")

	// The worker's own log lines go to stderr, as the README says.
	require.Regexp(t, regexp.MustCompile(`perspective worker started`), stderr.String())
	// And it really migrated and applied: the model is in the database it was given.
	var n int
	require.NoError(t, d.Pool.QueryRow(ctx, `SELECT count(*) FROM wh_perspective_models`).Scan(&n))
	require.Equal(t, 1, n)
}
