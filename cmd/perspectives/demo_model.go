package main

import (
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"time"

	"github.com/perspectives-go/perspectives/worker"
)

// demoPerspectiveName is the perspective the demo workers run.
const demoPerspectiveName = "demo_ledger"

// demoModel is an order-sensitive model: Digest chains every applied event ID, so a model
// that skipped, repeated or reordered an event differs from the expected one.
type demoModel struct {
	Version int    `json:"version,omitempty"` // 2 from version 2 of the perspective on
	Count   int    `json:"count"`
	Sum     int    `json:"sum"`
	Digest  string `json:"digest"`
}

type demoData struct {
	N int `json:"n"`
}

// foldDemo is version 1's fold; version 2 also records its version in the model.
func foldDemo(version int, m demoModel, ev worker.Event) (demoModel, error) {
	if version > 1 {
		m.Version = version
	}
	var d demoData
	if err := json.Unmarshal(ev.Data, &d); err != nil {
		return m, fmt.Errorf("event %s: %w", ev.ID, err)
	}
	h := sha256.Sum256(append([]byte(m.Digest), ev.ID[:]...))
	m.Count++
	m.Sum += d.N
	m.Digest = hex.EncodeToString(h[:8])
	return m, nil
}

// demoPerspective is the given version of the demo's perspective: it folds demo events,
// spending delay per event like a real projection would.
func demoPerspective(version int, delay time.Duration) worker.Perspective {
	return versionedDemo{version: version, Perspective: worker.JSONPerspective(demoPerspectiveName, func(m demoModel, ev worker.Event) (demoModel, error) {
		if delay > 0 {
			time.Sleep(delay)
		}
		return foldDemo(version, m, ev)
	})}
}

// versionedDemo is a version of the demo's perspective.
type versionedDemo struct {
	worker.Perspective
	version int
}

func (p versionedDemo) Version() int { return p.version }
