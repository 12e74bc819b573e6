package worker_test

import (
	"go/ast"
	"go/parser"
	"go/token"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"
)

// logMessages are the messages the non-test Go files of dirs log at WARN and ERROR (Warn,
// Error, and Log with a level that can be one of them), each with its level and where it is
// logged. A message is the call's first argument: a string
// literal (or a sum of them), or a variable whose string-literal values are its assignments
// in the same function, or a parameter of a function literal bound to a name, whose values
// are the literals passed to it there.
func logMessages(t *testing.T, dirs ...string) map[string][]string {
	t.Helper()
	out := map[string][]string{} // "LEVEL message" -> positions
	for _, dir := range dirs {
		files, err := filepath.Glob(filepath.Join(dir, "*.go"))
		require.NoError(t, err)
		for _, name := range files {
			if strings.HasSuffix(name, "_test.go") {
				continue
			}
			fset := token.NewFileSet()
			f, err := parser.ParseFile(fset, name, nil, 0)
			require.NoError(t, err)
			for _, decl := range f.Decls {
				fn, ok := decl.(*ast.FuncDecl)
				if !ok || fn.Body == nil {
					continue
				}
				ast.Inspect(fn.Body, func(n ast.Node) bool {
					call, ok := n.(*ast.CallExpr)
					if !ok || len(call.Args) == 0 {
						return true
					}
					sel, ok := call.Fun.(*ast.SelectorExpr)
					if !ok {
						return true
					}
					var levels []string
					msg := call.Args[0]
					switch sel.Sel.Name {
					case "Warn", "Error":
						levels = []string{strings.ToUpper(sel.Sel.Name)}
					case "Log": // Log(ctx, level, msg, …): the levels the level can have
						if len(call.Args) < 3 {
							return true
						}
						levels, msg = levelValues(fn.Body, call.Args[1]), call.Args[2]
					}
					if len(levels) == 0 {
						return true
					}
					msgs := messageValues(fn.Body, msg)
					require.NotEmpty(t, msgs, "%s: the message of this %s call is neither a string literal nor a variable assigned literals",
						fset.Position(call.Pos()), sel.Sel.Name)
					for _, l := range levels {
						for _, m := range msgs {
							key := l + " " + m
							out[key] = append(out[key], fset.Position(call.Pos()).String())
						}
					}
					return true
				})
			}
		}
	}
	return out
}

// levelValues are the levels WARN and ERROR that the slog level e can be in body: e itself
// (slog.LevelWarn, slog.LevelError), or a variable assigned them there.
func levelValues(body *ast.BlockStmt, e ast.Expr) []string {
	level := func(e ast.Expr) string {
		if sel, ok := e.(*ast.SelectorExpr); ok {
			switch sel.Sel.Name {
			case "LevelWarn":
				return "WARN"
			case "LevelError":
				return "ERROR"
			}
		}
		return ""
	}
	if l := level(e); l != "" {
		return []string{l}
	}
	id, ok := e.(*ast.Ident)
	if !ok {
		return nil
	}
	var out []string
	ast.Inspect(body, func(n ast.Node) bool {
		if x, ok := n.(*ast.AssignStmt); ok {
			for i, lhs := range x.Lhs {
				if l, ok := lhs.(*ast.Ident); ok && l.Name == id.Name && i < len(x.Rhs) {
					if v := level(x.Rhs[i]); v != "" && !slices.Contains(out, v) {
						out = append(out, v)
					}
				}
			}
		}
		return true
	})
	return out
}

// messageValues are the string values e can have in body (see logMessages).
func messageValues(body *ast.BlockStmt, e ast.Expr) []string {
	if s, ok := stringLit(e); ok {
		return []string{s}
	}
	id, ok := e.(*ast.Ident)
	if !ok {
		return nil
	}
	var out []string
	ast.Inspect(body, func(n ast.Node) bool {
		switch x := n.(type) {
		case *ast.AssignStmt: // msg := "…" / msg = "…"
			for i, lhs := range x.Lhs {
				if l, ok := lhs.(*ast.Ident); ok && l.Name == id.Name && i < len(x.Rhs) {
					if s, ok := stringLit(x.Rhs[i]); ok {
						out = append(out, s)
					}
				}
			}
			// f := func(…, msg string) {…}: the literals passed to f.
			if len(x.Lhs) != 1 || len(x.Rhs) != 1 {
				return true
			}
			f, ok1 := x.Lhs[0].(*ast.Ident)
			lit, ok2 := x.Rhs[0].(*ast.FuncLit)
			if !ok1 || !ok2 {
				return true
			}
			pos, i := -1, 0
			for _, p := range lit.Type.Params.List {
				for _, name := range p.Names {
					if name.Name == id.Name {
						pos = i
					}
					i++
				}
			}
			if pos < 0 {
				return true
			}
			ast.Inspect(body, func(n ast.Node) bool {
				if c, ok := n.(*ast.CallExpr); ok {
					if fid, ok := c.Fun.(*ast.Ident); ok && fid.Name == f.Name && pos < len(c.Args) {
						if s, ok := stringLit(c.Args[pos]); ok {
							out = append(out, s)
						}
					}
				}
				return true
			})
		}
		return true
	})
	return out
}

// stringLit is the value of a string literal or a sum of them.
func stringLit(e ast.Expr) (string, bool) {
	switch x := e.(type) {
	case *ast.BasicLit:
		if x.Kind != token.STRING {
			return "", false
		}
		s, err := strconv.Unquote(x.Value)
		return s, err == nil
	case *ast.BinaryExpr:
		a, ok1 := stringLit(x.X)
		b, ok2 := stringLit(x.Y)
		return a + b, ok1 && ok2 && x.Op == token.ADD
	case *ast.ParenExpr:
		return stringLit(x.X)
	}
	return "", false
}

// logsTable are the messages of the Logs section's table, "LEVEL message", each row's
// second column giving one or more messages in backquotes.
func logsTable(t *testing.T) map[string]bool {
	t.Helper()
	raw, err := os.ReadFile(operationsDoc)
	require.NoError(t, err)
	section := docSection(t, string(raw), "Logs")
	row := regexp.MustCompile(`^\| (WARN|ERROR) \| (.+?) \| `)
	quoted := regexp.MustCompile("`([^`]+)`")
	out := map[string]bool{}
	for _, l := range strings.Split(section, "\n") {
		m := row.FindStringSubmatch(l)
		if m == nil {
			continue
		}
		for _, q := range quoted.FindAllStringSubmatch(m[2], -1) {
			out[m[1]+" "+q[1]] = true
		}
	}
	require.NotEmpty(t, out, "%s: no WARN or ERROR rows under Logs", operationsDoc)
	return out
}

// Every message the worker and the locker log at WARN or ERROR has its row, at its level,
// in the operations guide's Logs table, and every row names a message the code logs.
func TestLogsDocListsEveryWarningAndError(t *testing.T) {
	code := logMessages(t, ".", "../locker")
	doc := logsTable(t)
	var undocumented, stale []string
	for m, at := range code {
		if !doc[m] {
			undocumented = append(undocumented, m+" (at "+strings.Join(at, ", ")+")")
		}
	}
	for m := range doc {
		if _, ok := code[m]; !ok {
			stale = append(stale, m)
		}
	}
	slices.Sort(undocumented)
	slices.Sort(stale)
	require.Empty(t, undocumented, "logged but not in %s's Logs table (level and message)", operationsDoc)
	require.Empty(t, stale, "in %s's Logs table but not logged at that level", operationsDoc)
}
