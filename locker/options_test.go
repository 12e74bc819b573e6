package locker_test

import (
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/perspectives-go/perspectives/locker"
)

func TestDefaultOptions(t *testing.T) {
	t.Parallel()
	d := locker.DefaultOptions()
	require.Equal(t, 30*time.Second, d.LockTimeout)
	require.Equal(t, 10*time.Second, d.KeepAliveInterval)
	require.Equal(t, d, locker.Options{}.WithDefaults())
	// WithDefaults fills only zero fields.
	require.Equal(t, locker.Options{LockTimeout: 45 * time.Second, KeepAliveInterval: 10 * time.Second},
		locker.Options{LockTimeout: 45 * time.Second}.WithDefaults())
	require.Equal(t, locker.Options{LockTimeout: 30 * time.Second, KeepAliveInterval: 3 * time.Second},
		locker.Options{KeepAliveInterval: 3 * time.Second}.WithDefaults())
}

func TestOptionsValidate(t *testing.T) {
	t.Parallel()
	cases := []struct {
		name string
		opts locker.Options
		// wantErr lists substrings the error must contain; nil means the options are valid.
		wantErr []string
		// wantNot lists substrings the error must not contain.
		wantNot []string
	}{
		{name: "defaults", opts: locker.DefaultOptions()},
		{name: "zero value means defaults", opts: locker.Options{}},
		{name: "long timeout with default keepalive", opts: locker.Options{LockTimeout: 60 * time.Second}},
		{name: "short keepalive with default timeout", opts: locker.Options{KeepAliveInterval: time.Second}},
		{name: "keepalive just under half the timeout", opts: locker.Options{LockTimeout: 30 * time.Second, KeepAliveInterval: 15*time.Second - time.Nanosecond}},
		{name: "small but consistent", opts: locker.Options{LockTimeout: time.Second, KeepAliveInterval: 100 * time.Millisecond}},
		{
			name:    "timeout 20s leaves default keepalive 10s at exactly half",
			opts:    locker.Options{LockTimeout: 20 * time.Second},
			wantErr: []string{"KeepAliveInterval", "10s", "20s"},
		},
		{
			name:    "keepalive equal to half the timeout",
			opts:    locker.Options{LockTimeout: 30 * time.Second, KeepAliveInterval: 15 * time.Second},
			wantErr: []string{"KeepAliveInterval", "15s", "30s"},
		},
		{
			name:    "keepalive half of the default timeout",
			opts:    locker.Options{KeepAliveInterval: 15 * time.Second},
			wantErr: []string{"KeepAliveInterval", "15s", "30s"},
		},
		{
			name:    "keepalive longer than the timeout",
			opts:    locker.Options{LockTimeout: 30 * time.Second, KeepAliveInterval: 40 * time.Second},
			wantErr: []string{"KeepAliveInterval", "40s", "30s"},
		},
		{
			name:    "negative timeout",
			opts:    locker.Options{LockTimeout: -time.Second},
			wantErr: []string{"LockTimeout", "-1s"},
			// The fault is the timeout's sign, not the keepalive ratio.
			wantNot: []string{"KeepAliveInterval"},
		},
		{
			name:    "negative timeout with valid keepalive",
			opts:    locker.Options{LockTimeout: -5 * time.Second, KeepAliveInterval: time.Second},
			wantErr: []string{"LockTimeout", "-5s"},
			wantNot: []string{"KeepAliveInterval"},
		},
		{
			name:    "negative keepalive",
			opts:    locker.Options{KeepAliveInterval: -2 * time.Second},
			wantErr: []string{"KeepAliveInterval", "-2s"},
		},
		{
			name:    "negative keepalive with explicit timeout",
			opts:    locker.Options{LockTimeout: 30 * time.Second, KeepAliveInterval: -time.Millisecond},
			wantErr: []string{"KeepAliveInterval", "-1ms"},
		},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			err := tc.opts.Validate()
			if tc.wantErr == nil {
				require.NoError(t, err)
				return
			}
			require.Error(t, err)
			require.ErrorIs(t, err, locker.ErrInvalidOptions)
			require.NotErrorIs(t, err, locker.ErrInvalidArgument)
			for _, s := range tc.wantErr {
				require.ErrorContains(t, err, s)
			}
			for _, s := range tc.wantNot {
				require.NotContains(t, err.Error(), s)
			}
		})
	}
}

func TestNewPostgresRefusesInvalidOptions(t *testing.T) {
	t.Parallel()
	for _, opts := range []locker.Options{
		{LockTimeout: 20 * time.Second},
		{LockTimeout: -time.Second},
		{KeepAliveInterval: -time.Second},
		{LockTimeout: 30 * time.Second, KeepAliveInterval: 15 * time.Second},
	} {
		l, err := locker.NewPostgres(testDB.Pool, opts)
		require.ErrorIs(t, err, locker.ErrInvalidOptions, "options %+v", opts)
		require.Nil(t, l)
	}
}

func TestNewPostgresRefusesNilPool(t *testing.T) {
	t.Parallel()
	l, err := locker.NewPostgres(nil, locker.Options{})
	require.ErrorIs(t, err, locker.ErrInvalidArgument)
	require.ErrorContains(t, err, "pool")
	require.Nil(t, l)
}

func TestNewPostgresFillsDefaults(t *testing.T) {
	t.Parallel()
	require.Equal(t, locker.DefaultOptions(), newLocker(t, locker.Options{}).Options())
	require.Equal(t, locker.Options{LockTimeout: 45 * time.Second, KeepAliveInterval: 10 * time.Second},
		newLocker(t, locker.Options{LockTimeout: 45 * time.Second}).Options())
}
