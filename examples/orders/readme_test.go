package main

import (
	"fmt"
	"os"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"
)

// The README's section "Read models in your own tables" quotes the example, so that it
// cannot drift from it: each line of its blocks (the code before a comment; a line that is
// only a comment is the README's own) is a line of the example's file, in the same order;
// and the typed read it names is main.go's.
func TestReadmeQuotesTheExample(t *testing.T) {
	t.Parallel()
	raw, err := os.ReadFile("../../README.md")
	require.NoError(t, err)
	const heading = "\n## Read models in your own tables\n"
	i := strings.Index(string(raw), heading)
	require.GreaterOrEqual(t, i, 0, "README.md has no section %q", strings.TrimSpace(heading))
	section := string(raw)[i+len(heading):]
	if j := strings.Index(section, "\n## "); j >= 0 {
		section = section[:j]
	}
	for lang, file := range map[string]string{"sql": "schema/000001_orders.up.sql", "go": "order/sink.go"} {
		src, err := os.ReadFile(file)
		require.NoError(t, err)
		block := fenced(t, section, lang)
		require.NoError(t, quotes(block, string(src)), "the README's %s block quotes %s", lang, file)
	}
	mainGo, err := os.ReadFile("main.go")
	require.NoError(t, err)
	require.Contains(t, section, "`db.New(pool).OpenOrdersOver(ctx, 5000)`")
	require.Contains(t, string(mainGo), "db.New(pool).OpenOrdersOver(ctx, 5000)")
	require.Contains(t, section, "[examples/orders/](examples/orders/)")
}

// fenced is the body of the first ```lang block of text.
func fenced(t *testing.T, text, lang string) string {
	t.Helper()
	open := "```" + lang + "\n"
	k := strings.Index(text, open)
	require.GreaterOrEqual(t, k, 0, "no ```%s block", lang)
	body := text[k+len(open):]
	end := strings.Index(body, "\n```")
	require.GreaterOrEqual(t, end, 0, "unterminated ```%s block", lang)
	return body[:end]
}

// quotes says which line of snippet is not, in order, a line of src (compared by their
// code, trimmed), if one is not.
func quotes(snippet, src string) error {
	lines := strings.Split(src, "\n")
	at := 0
	for _, s := range strings.Split(snippet, "\n") {
		want := code(s)
		if want == "" {
			continue
		}
		for at < len(lines) && code(lines[at]) != want {
			at++
		}
		if at == len(lines) {
			return fmt.Errorf("not in the source, or out of order: %q", s)
		}
		at++
	}
	return nil
}

// code is line without its comment, trimmed.
func code(line string) string {
	if i := strings.Index(line, "//"); i >= 0 {
		line = line[:i]
	}
	return strings.TrimSpace(line)
}
