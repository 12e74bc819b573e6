package worker_test

import (
	"errors"
	"os"
	"reflect"
	"strconv"
	"strings"
	"testing"
	"time"
	"unicode"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/perspectives-go/perspectives/fxmodule"
	"github.com/perspectives-go/perspectives/locker"
	"github.com/perspectives-go/perspectives/ui"
	"github.com/perspectives-go/perspectives/worker"
)

// configurationDoc is the configuration reference, relative to this package.
const configurationDoc = "../docs/configuration.md"

// configurationColumns are the columns of each struct's table in configurationDoc.
var configurationColumns = []string{"field", "type", "default", "valid", "at zero", "meaning"}

// docSection is the text under the one heading of text that names title as `title`, up to
// the next heading of the same or a higher level.
func docSection(t *testing.T, text, title string) string {
	t.Helper()
	lines := strings.Split(text, "\n")
	start, level := -1, 0
	for i, l := range lines {
		if !strings.HasPrefix(l, "#") || !strings.Contains(l, title) {
			continue
		}
		require.Equal(t, -1, start, "%s: more than one heading names %s", configurationDoc, title)
		start, level = i, len(l)-len(strings.TrimLeft(l, "#"))
	}
	require.NotEqual(t, -1, start, "%s: no heading names %s", configurationDoc, title)
	end := len(lines)
	for i := start + 1; i < len(lines); i++ {
		l := lines[i]
		if n := len(l) - len(strings.TrimLeft(l, "#")); n > 0 && n <= level && strings.HasPrefix(l[n:], " ") {
			end = i
			break
		}
	}
	return strings.Join(lines[start+1:end], "\n")
}

// docTable is the first table of section: its header's cells, and its rows by the name in
// their first cell ("| `Name` | …").
func docTable(t *testing.T, section, title string) (header []string, rows map[string][]string) {
	t.Helper()
	rows = map[string][]string{}
	for _, l := range strings.Split(section, "\n") {
		if !strings.HasPrefix(l, "|") {
			if header != nil {
				break // the end of the first table
			}
			continue
		}
		cells := strings.Split(strings.Trim(l, "|"), "|")
		for i := range cells {
			cells[i] = strings.TrimSpace(cells[i])
		}
		switch {
		case header == nil:
			header = cells
		case strings.Trim(cells[0], "-") == "":
			// the separator line
		default:
			name := strings.Trim(cells[0], "`")
			require.Equal(t, "`"+name+"`", cells[0], "%s, %s: a row's first cell is a field name in backquotes: %q", configurationDoc, title, l)
			require.NotContains(t, rows, name, "%s, %s: %s has two rows", configurationDoc, title, name)
			rows[name] = cells
		}
	}
	require.NotNil(t, header, "%s, %s: no table", configurationDoc, title)
	return header, rows
}

// docDuration is d as the documents write it: 5m, not 5m0s.
func docDuration(d time.Duration) string {
	s := d.String()
	if strings.HasSuffix(s, "m0s") {
		s = strings.TrimSuffix(s, "0s")
	}
	if strings.HasSuffix(s, "h0m") {
		s = strings.TrimSuffix(s, "0m")
	}
	return s
}

// docRange is an integer range as the documents write it.
func docRange(lo, hi int) string { return strconv.Itoa(lo) + "–" + strconv.Itoa(hi) }

// startsWithValue reports whether cell begins with want, not followed by a digit or a dot.
func startsWithValue(cell, want string) bool {
	rest, ok := strings.CutPrefix(cell, want)
	return ok && (rest == "" || !unicode.IsDigit(rune(rest[0])) && rest[0] != '.')
}

// docStruct is an options struct and what its table in configurationDoc must say.
type docStruct struct {
	title    string // in the heading of its section, e.g. `worker.Config`
	typ      reflect.Type
	defaults map[string]string // field → the beginning of its default cell
	valid    map[string]string // field → the beginning of its valid cell
}

func documentedStructs() []docStruct {
	return []docStruct{
		{
			title: "`worker.Config`", typ: reflect.TypeFor[worker.Config](),
			defaults: map[string]string{
				"PollInterval":    docDuration(worker.DefaultPollInterval),
				"BatchSize":       strconv.Itoa(worker.DefaultBatchSize),
				"RetryBackoff":    docDuration(worker.DefaultRetryBackoff),
				"MaxRetryBackoff": docDuration(worker.DefaultMaxRetryBackoff),
				"Concurrency":     strconv.Itoa(worker.DefaultConcurrency),
				"CatchUpPageSize": strconv.Itoa(worker.DefaultCatchUpPageSize),
				"GroupSize":       strconv.Itoa(worker.DefaultGroupSize),
				"FailurePolicy":   "park after " + strconv.Itoa(worker.DefaultFailureAttempts),
				"LockOptions": "the locker's options, else `LockTimeout` " + docDuration(locker.DefaultLockTimeout) +
					", `KeepAliveInterval` " + docDuration(locker.DefaultKeepAliveInterval),
				"Snapshots": "enabled, every " + strconv.Itoa(worker.DefaultSnapshotEveryNEvents) +
					" events, " + strconv.Itoa(worker.DefaultSnapshotMaxPerStream) + " kept",
				"PollOnly":        "false",
				"ManualPromotion": "false",
			},
			valid: map[string]string{
				"BatchSize":       docRange(1, worker.MaxBatchSize),
				"Concurrency":     docRange(1, worker.MaxConcurrency),
				"CatchUpPageSize": docRange(1, worker.MaxCatchUpPageSize),
				"GroupSize":       docRange(1, worker.MaxGroupSize),
			},
		},
		{
			title: "`worker.SnapshotOptions`", typ: reflect.TypeFor[worker.SnapshotOptions](),
			defaults: map[string]string{
				"Disabled":     "false",
				"EveryNEvents": strconv.Itoa(worker.DefaultSnapshotEveryNEvents),
				"MaxPerStream": strconv.Itoa(worker.DefaultSnapshotMaxPerStream),
			},
		},
		{
			title: "`worker.FailurePolicy`", typ: reflect.TypeFor[worker.FailurePolicy](),
			defaults: map[string]string{"Attempts": strconv.Itoa(worker.DefaultFailureAttempts), "Skip": "false"},
			valid:    map[string]string{"Attempts": docRange(1, worker.MaxFailureAttempts)},
		},
		{
			title: "`locker.Options`", typ: reflect.TypeFor[locker.Options](),
			defaults: map[string]string{
				"LockTimeout":       docDuration(locker.DefaultLockTimeout),
				"KeepAliveInterval": docDuration(locker.DefaultKeepAliveInterval),
			},
		},
		{
			title: "`ui.Options`", typ: reflect.TypeFor[ui.Options](),
			defaults: map[string]string{"Prefix": "`\"\"`", "ReadOnly": "false", "Token": "`\"\"`", "Locker": "nil", "Logger": "nil"},
		},
	}
}

// docs/configuration.md documents every exported field of every options struct, in the
// table of its struct's section, with its type, default, valid values, zero value and
// meaning; the defaults and bounds it gives are the code's constants; and it documents no
// field that does not exist.
func TestConfigurationDocDocumentsEveryField(t *testing.T) {
	t.Parallel()
	b, err := os.ReadFile(configurationDoc)
	require.NoError(t, err)
	text := string(b)
	for _, s := range documentedStructs() {
		header, rows := docTable(t, docSection(t, text, s.title), s.title)
		require.Equal(t, configurationColumns, header, "%s, %s: the table's columns", configurationDoc, s.title)
		fields := map[string]bool{}
		for f := range s.typ.Fields() {
			if !f.IsExported() {
				continue
			}
			fields[f.Name] = true
			row, ok := rows[f.Name]
			require.True(t, ok, "%s does not document %s.%s: no row \"| `%s` |\" in the table under the heading naming %s",
				configurationDoc, s.typ, f.Name, f.Name, s.title)
			require.Len(t, row, len(configurationColumns), "%s, %s.%s: the row's cells", configurationDoc, s.typ, f.Name)
			for i, c := range row {
				require.NotEmpty(t, c, "%s, %s.%s: the %q cell is empty", configurationDoc, s.typ, f.Name, configurationColumns[i])
			}
			require.Equal(t, "`"+f.Type.String()+"`", row[1], "%s, %s.%s: its type", configurationDoc, s.typ, f.Name)
			if want, ok := s.defaults[f.Name]; ok {
				require.True(t, startsWithValue(row[2], want), "%s, %s.%s: its default is %q in the code, the document says %q",
					configurationDoc, s.typ, f.Name, want, row[2])
			}
			if want, ok := s.valid[f.Name]; ok {
				require.True(t, startsWithValue(row[3], want), "%s, %s.%s: its valid values are %q in the code, the document says %q",
					configurationDoc, s.typ, f.Name, want, row[3])
			}
		}
		for name := range rows {
			require.True(t, fields[name], "%s documents %s.%s, which is not an exported field", configurationDoc, s.typ, name)
		}
		for name := range s.defaults {
			require.True(t, fields[name], "the test checks the default of %s.%s, which is not a field", s.typ, name)
		}
		for name := range s.valid {
			require.True(t, fields[name], "the test checks the valid values of %s.%s, which is not a field", s.typ, name)
		}
	}
}

// docs/configuration.md's section on the fx module names every value the module's
// constructors take from the graph, in its table.
func TestConfigurationDocNamesWhatTheFxModuleTakes(t *testing.T) {
	t.Parallel()
	b, err := os.ReadFile(configurationDoc)
	require.NoError(t, err)
	section := docSection(t, string(b), "The fx module")
	for _, params := range []reflect.Type{reflect.TypeFor[fxmodule.WorkerParams](), reflect.TypeFor[fxmodule.LockerParams]()} {
		for f := range params.Fields() {
			if f.Anonymous || f.Name == "Lifecycle" { // fx.In, and fx's own lifecycle
				continue
			}
			typ := f.Type
			if typ.Kind() == reflect.Slice { // a value group: its values
				typ = typ.Elem()
			}
			require.Contains(t, section, "\n| `"+typ.String()+"`", "%s, the fx module: no row for the %s that %s.%s takes",
				configurationDoc, typ, params, f.Name)
		}
	}
}

// The validation errors docs/configuration.md shows are the ones the code returns, and wrap
// the sentinels it names.
func TestConfigurationDocValidationErrorsAreTheCodes(t *testing.T) {
	t.Parallel()
	b, err := os.ReadFile(configurationDoc)
	require.NoError(t, err)
	text := string(b)
	pool := testDB.Pool
	orders := ledgerPerspective("orders")
	one := []worker.Perspective{orders}
	pg, err := locker.NewPostgres(pool, locker.Options{})
	require.NoError(t, err)
	newWorker := func(pool *pgxpool.Pool, cfg worker.Config) error {
		w, err := worker.New(pool, cfg)
		require.Nil(t, w)
		return err
	}
	newLocker := func(opts locker.Options) error {
		_, err := locker.NewPostgres(pool, opts)
		return err
	}
	newHandler := func(pool *pgxpool.Pool, opts ui.Options) error {
		_, err := ui.NewHandler(pool, opts)
		return err
	}
	for _, c := range []struct {
		err       error
		sentinels []error
	}{
		{newWorker(pool, worker.Config{Perspectives: one, BatchSize: 20000}), []error{worker.ErrInvalidConfig}},
		{newWorker(pool, worker.Config{Perspectives: []worker.Perspective{orders, orders}}), []error{worker.ErrInvalidConfig}},
		{newWorker(pool, worker.Config{Perspectives: one, FailurePolicies: map[string]worker.FailurePolicy{"orders": {Attempts: -1}}}),
			[]error{worker.ErrInvalidConfig}},
		{newWorker(pool, worker.Config{Perspectives: one, LockOptions: locker.Options{LockTimeout: 10 * time.Second, KeepAliveInterval: 5 * time.Second}}),
			[]error{worker.ErrInvalidConfig, locker.ErrInvalidOptions}},
		{newWorker(pool, worker.Config{Perspectives: one, Locker: pg, LockOptions: locker.Options{LockTimeout: time.Minute}}),
			[]error{worker.ErrInvalidConfig}},
		{newWorker(nil, worker.Config{Perspectives: one}), []error{worker.ErrInvalidConfig}},
		{newLocker(locker.Options{LockTimeout: -time.Second}), []error{locker.ErrInvalidOptions}},
		{newHandler(pool, ui.Options{Prefix: "ops"}), []error{ui.ErrInvalidOptions}},
		{newHandler(nil, ui.Options{}), []error{ui.ErrInvalidOptions}},
	} {
		require.Error(t, c.err)
		for _, s := range c.sentinels {
			require.True(t, errors.Is(c.err, s), "%q wraps %v", c.err, s)
		}
		require.Contains(t, text, c.err.Error(), "%s shows the error as the code writes it", configurationDoc)
	}
}
