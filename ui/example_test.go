package ui_test

import (
	"context"
	"fmt"
	"log"
	"log/slog"
	"net/http"
	"net/http/httptest"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/perspectives-go/perspectives/ui"
)

// The dashboard mounted under a path of the application's own server (docs/operations.md,
// "The dashboard").
func ExampleNewHandler() {
	ctx := context.Background()
	pool, err := pgxpool.New(ctx, databaseURL()) // the application's pool
	if err != nil {
		log.Fatal(err)
	}
	defer pool.Close()
	dash, err := ui.NewHandler(pool, ui.Options{
		Prefix:   "/ops/perspectives", // where it is mounted; its links are built with it
		Token:    "s3cret",            // "": none (serve it on localhost, or behind your own auth)
		ReadOnly: false,               // true: no Retry, Skip or Force release
		Logger:   slog.New(slog.DiscardHandler),
	})
	if err != nil {
		log.Fatal(err)
	}
	mux := http.NewServeMux()
	mux.Handle("/ops/perspectives/", dash) // no http.StripPrefix
	srv := httptest.NewServer(mux)         // in production: http.ListenAndServe("127.0.0.1:8080", mux)
	defer srv.Close()

	for _, token := range []string{"", "s3cret"} {
		req, err := http.NewRequest(http.MethodGet, srv.URL+"/ops/perspectives/", nil)
		if err != nil {
			log.Fatal(err)
		}
		if token != "" {
			req.Header.Set("Authorization", "Bearer "+token)
		}
		res, err := http.DefaultClient.Do(req)
		if err != nil {
			log.Fatal(err)
		}
		res.Body.Close()
		fmt.Printf("token %q: %s\n", token, res.Status)
	}
	// Output:
	// token "": 401 Unauthorized
	// token "s3cret": 200 OK
}
