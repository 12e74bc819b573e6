.DEFAULT_GOAL := help
SHELL := /bin/bash

DATABASE_URL ?= postgres://postgres@127.0.0.1:5432/postgres?sslmode=disable
export DATABASE_URL

# sqlc and staticcheck are pinned in tools/go.mod (kept out of the library's go.mod).
SQLC        := cd tools && go tool sqlc
STATICCHECK := go tool -modfile=tools/go.mod staticcheck

.PHONY: help generate verify test test-pooler bench demo db reliability

help: ## list the targets
	@grep -hE '^[a-zA-Z_-]+:.*## ' $(MAKEFILE_LIST) | awk 'BEGIN {FS = ":.*## "}; {printf "  %-10s %s\n", $$1, $$2}'

# GENERATED is the code make generate writes: the library's, and the orders example's (its
# db/ folder also holds generate.go, which is not generated).
GENERATED := db mocks examples/orders/mocks examples/orders/db ':!examples/orders/db/generate.go'

generate: ## regenerate db/ and examples/orders/db/ with sqlc, mocks/ and examples/orders/mocks/ with moq
	$(SQLC) -f ../sqlc.yaml generate
	$(SQLC) -f ../examples/orders/sqlc.yaml generate
	go generate ./...

verify: generate ## check generated code is current, gofmt, go.mod tidy, go vet and staticcheck clean
	@unformatted=$$(gofmt -l $$(git ls-files '*.go')); \
	  if [ -n "$$unformatted" ]; then echo "not gofmt-ed: $$unformatted"; exit 1; fi
	git diff --exit-code -- $(GENERATED)
	@untracked=$$(git ls-files --others --exclude-standard -- $(GENERATED)); \
	  if [ -n "$$untracked" ]; then echo "untracked generated files: $$untracked"; exit 1; fi
	go mod tidy -diff
	cd tools && go mod tidy -diff
	go vet ./...
	$(STATICCHECK) ./...

db: ## make sure PostgreSQL answers at DATABASE_URL (starts or installs the local cluster)
	@./scripts/db.sh

test: db ## run every test against PostgreSQL, with the race detector, then the pooler suite
	./scripts/cgo.sh
	go test -race -count=1 ./...
	./scripts/test-pooler.sh

test-pooler: db ## the locker, worker, fx and CLI tests through PgBouncer in transaction mode (exec, simple_protocol; pgx's default mode where PgBouncer >= 1.21 is installed)
	./scripts/cgo.sh
	./scripts/test-pooler.sh

bench: db ## run the benchmarks and write their results into BENCHMARKS.md (BENCH=regexp, BENCH_COUNT=n)
	set -o pipefail; go test -run '^$$' -bench "$${BENCH:-.}" -benchtime 1x -count "$${BENCH_COUNT:-3}" -p 1 -timeout 60m ./... 2>&1 | go run ./bench -write BENCHMARKS.md

demo: db ## run the demo: several workers, late events, a killed instance, a consistency check
	go run ./cmd/perspectives demo

reliability: db ## the reliability suite with a 2-minute randomized model check (RELIABILITY_SEED=N replays a schedule)
	./scripts/cgo.sh
	RELIABILITY_BUDGET=$${RELIABILITY_BUDGET:-2m} go test -race -count=1 -timeout 30m -v -run 'Reliab' ./worker/
