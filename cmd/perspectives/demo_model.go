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
	Count  int    `json:"count"`
	Sum    int    `json:"sum"`
	Digest string `json:"digest"`
}

type demoData struct {
	N int `json:"n"`
}

func foldDemo(m demoModel, ev worker.Event) (demoModel, error) {
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

// demoPerspective folds demo events, spending delay per event like a real projection would.
func demoPerspective(delay time.Duration) worker.Perspective {
	return worker.JSONPerspective(demoPerspectiveName, func(m demoModel, ev worker.Event) (demoModel, error) {
		if delay > 0 {
			time.Sleep(delay)
		}
		return foldDemo(m, ev)
	})
}
