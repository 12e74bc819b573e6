package main

import (
	"flag"
	"fmt"
	"io"
	"os"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

// cliDoc is the command-line reference that TestCLIDocMatchesTheCode holds to the code.
const cliDoc = "../../docs/cli.md"

// docSection is one command's section of docs/cli.md.
type docSection struct {
	text  string
	flags map[string]docFlag // by name, without the dashes
}

// docFlag is one row of a section's flag table.
type docFlag struct{ typ, def string }

var (
	docHeading = regexp.MustCompile("^## `perspectives ([a-z-]+)`$")
	docFlagRow = regexp.MustCompile("^\\| `--([a-z-]+)` \\| ([a-z0-9]+) \\| ([^|]+) \\|")
	docExit    = regexp.MustCompile("(?s)\\*\\*Exit status\\.\\*\\*(.*?)(?:\n\n|$)")
	docCode    = regexp.MustCompile("`([0-9])`")
	docExitRow = regexp.MustCompile("(?m)^\\| `([0-9])` \\|")
	backticked = regexp.MustCompile("`([^`]*)`")
)

// parseCLIDoc splits docs/cli.md into its command sections (the text under "## `perspectives
// NAME`" up to the next "## ") and the rest.
func parseCLIDoc(t *testing.T, doc string) (map[string]docSection, string) {
	t.Helper()
	sections := map[string]docSection{}
	var rest strings.Builder
	var name string
	var cur *strings.Builder
	flush := func() {
		if cur == nil {
			return
		}
		sec := docSection{text: cur.String(), flags: map[string]docFlag{}}
		for _, line := range strings.Split(sec.text, "\n") {
			if m := docFlagRow.FindStringSubmatch(line); m != nil {
				_, dup := sec.flags[m[1]]
				require.False(t, dup, "%s: --%s is in the flag table twice", name, m[1])
				sec.flags[m[1]] = docFlag{typ: m[2], def: strings.TrimSpace(m[3])}
			}
		}
		sections[name] = sec
		cur = nil
	}
	for _, line := range strings.Split(doc, "\n") {
		if strings.HasPrefix(line, "## ") {
			flush()
			if m := docHeading.FindStringSubmatch(line); m != nil {
				name, cur = m[1], &strings.Builder{}
				_, dup := sections[name]
				require.False(t, dup, "two sections for %s", name)
				continue
			}
		}
		if cur != nil {
			cur.WriteString(line + "\n")
		} else {
			rest.WriteString(line + "\n")
		}
	}
	flush()
	return sections, rest.String()
}

// flagType is the name docs/cli.md gives a flag's type.
func flagType(f *flag.Flag) string {
	switch f.Value.(flag.Getter).Get().(type) {
	case string:
		return "string"
	case bool:
		return "bool"
	case int:
		return "int"
	case uint64:
		return "uint"
	case float64:
		return "float"
	case time.Duration:
		return "duration"
	}
	return fmt.Sprintf("%T", f.Value.(flag.Getter).Get())
}

// sameDefault reports whether the documented default s (a backticked value) is the flag's
// default, read as a value of the flag's type: `10m` is the duration 10m0s.
func sameDefault(f *flag.Flag, s string) bool {
	v := f.Value.(flag.Getter).Get()
	switch v := v.(type) {
	case bool:
		b, err := strconv.ParseBool(s)
		return err == nil && b == v
	case int:
		n, err := strconv.Atoi(s)
		return err == nil && n == v
	case uint64:
		n, err := strconv.ParseUint(s, 10, 64)
		return err == nil && n == v
	case float64:
		x, err := strconv.ParseFloat(s, 64)
		return err == nil && x == v
	case time.Duration:
		d, err := time.ParseDuration(s)
		return err == nil && d == v
	}
	return s == f.DefValue
}

// dynamicDefaults are the flags whose default the code computes when the command runs; the
// doc gives the rule instead of a value, and TestDynamicDefaults checks the rule.
var dynamicDefaults = map[string]string{
	"database-url": "[`$DATABASE_URL`, else the local default](#the-database)",
	"seed":         "the current time (Unix nanoseconds)",
	"by":           "`user@host`, from the operating system's user (else `$USER`) and host names",
}

// TestCLIDocMatchesTheCode holds docs/cli.md to the commands: a section for each, with the
// usage line its --help prints, every flag of its flag set with the type and default the
// code gives it and no other, and the exit codes the code returns.
func TestCLIDocMatchesTheCode(t *testing.T) {
	raw, err := os.ReadFile(cliDoc)
	require.NoError(t, err)
	sections, rest := parseCLIDoc(t, string(raw))

	var documented []string
	for _, c := range commands() {
		sec, ok := sections[c.name]
		if c.internal() {
			require.False(t, ok, "the internal command %s is documented", c.name)
			continue
		}
		documented = append(documented, c.name)
		require.True(t, ok, "docs/cli.md has no section \"## `perspectives %s`\"", c.name)
		usageLine := "perspectives " + c.synopsis
		require.True(t, strings.Contains(sec.text, "```sh\n"+usageLine+"\n```"),
			"%s: the section has no code block with the usage line --help prints: %s", c.name, usageLine)

		fs, _, _ := c.flagSet(io.Discard)
		var defined []string
		fs.VisitAll(func(f *flag.Flag) {
			defined = append(defined, f.Name)
			d, ok := sec.flags[f.Name]
			if !ok {
				t.Errorf("%s: --%s (default %q) is not in its flag table", c.name, f.Name, f.DefValue)
				return
			}
			if d.typ != flagType(f) {
				t.Errorf("%s --%s: the doc says type %s, the code %s", c.name, f.Name, d.typ, flagType(f))
			}
			if rule, ok := dynamicDefaults[f.Name]; ok {
				if d.def != rule {
					t.Errorf("%s --%s: its default is documented as %q, want %q", c.name, f.Name, d.def, rule)
				}
				return
			}
			m := backticked.FindStringSubmatch(d.def)
			switch {
			case f.DefValue == "" && flagType(f) == "string":
				if !strings.HasPrefix(d.def, "none") {
					t.Errorf("%s --%s: the code's default is empty, the doc's %q (want \"none…\")", c.name, f.Name, d.def)
				}
			case m == nil || !strings.HasPrefix(d.def, "`"):
				t.Errorf("%s --%s: the default %q does not begin with a `value`; the code's is %s", c.name, f.Name, d.def, f.DefValue)
			case !sameDefault(f, m[1]):
				t.Errorf("%s --%s: the doc's default is %s, the code's %s", c.name, f.Name, m[1], f.DefValue)
			}
		})
		for name := range sec.flags {
			if !slices.Contains(defined, name) {
				t.Errorf("%s: --%s is documented, but the command has no such flag", c.name, name)
			}
		}
		for _, arg := range regexp.MustCompile(`--([a-z-]+)`).FindAllStringSubmatch(c.synopsis, -1) {
			require.Contains(t, defined, arg[1], "%s: its usage line names --%s", c.name, arg[1])
		}

		exit := docExit.FindStringSubmatch(sec.text)
		require.NotNil(t, exit, "%s: no **Exit status.** paragraph", c.name)
		var codes []int
		for _, m := range docCode.FindAllStringSubmatch(exit[1], -1) {
			n, _ := strconv.Atoi(m[1])
			codes = append(codes, n)
		}
		want := []int{exitOK, exitFailed, exitUsage}
		if c.name == "status" {
			want = []int{exitOK, exitParked, exitFailed, exitUsage}
		}
		require.Equal(t, want, codes, "%s: the exit codes of its **Exit status.** paragraph, in order", c.name)
	}
	for name := range sections {
		require.Contains(t, documented, name, "docs/cli.md documents a command %s that commands() does not have", name)
	}

	var codes []int
	for _, m := range docExitRow.FindAllStringSubmatch(rest, -1) {
		n, _ := strconv.Atoi(m[1])
		codes = append(codes, n)
	}
	require.Equal(t, []int{exitOK, exitFailed, exitUsage, exitParked}, codes, "the table of exit codes")
	require.Contains(t, rest, "`"+DefaultDatabaseURL+"`", "the database section names the default URL")
	for _, c := range documented {
		require.Contains(t, rest, "(#perspectives-"+c+")", "the contents link to %s", c)
	}
}

// TestDynamicDefaults checks the rules dynamicDefaults documents.
func TestDynamicDefaults(t *testing.T) {
	def := func(command, name string) string {
		for _, c := range commands() {
			if c.name == command {
				fs, _, _ := c.flagSet(io.Discard)
				return fs.Lookup(name).DefValue
			}
		}
		t.Fatalf("no command %s", command)
		return ""
	}
	t.Setenv("DATABASE_URL", "")
	for _, c := range commands() {
		require.Equal(t, DefaultDatabaseURL, def(c.name, "database-url"), c.name)
	}
	t.Setenv("DATABASE_URL", "postgres://elsewhere/db")
	require.Equal(t, "postgres://elsewhere/db", def("status", "database-url"))

	before := uint64(time.Now().UnixNano())
	seed, err := strconv.ParseUint(def("demo", "seed"), 10, 64)
	require.NoError(t, err)
	require.GreaterOrEqual(t, seed, before, "the seed is the current time in nanoseconds")
	require.LessOrEqual(t, seed, uint64(time.Now().UnixNano()))

	require.Equal(t, defaultOperator(), def("skip", "by"))
	require.Contains(t, defaultOperator(), "@", "user@host")
}
