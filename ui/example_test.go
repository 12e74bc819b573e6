package ui_test

import (
	"fmt"
	"net/http"
	"net/http/httptest"

	"github.com/perspectives-go/perspectives/ui"
)

// The README's "Dashboard" snippet: the dashboard mounted under a path of the application's
// own server.
func ExampleNewHandler() {
	pool := testDB.Pool // your *pgxpool.Pool
	dash, err := ui.NewHandler(pool, ui.Options{
		Prefix:   "/ops/perspectives", // where it is mounted; its links are built with it
		Token:    "s3cret",            // "": none (serve it on localhost, or behind your own auth)
		ReadOnly: false,               // true: no Retry, Skip or Force release
		Logger:   quietLogger(),
	})
	if err != nil {
		panic(err)
	}
	mux := http.NewServeMux()
	mux.Handle("/ops/perspectives/", dash) // no http.StripPrefix
	srv := httptest.NewServer(mux)         // in production: http.ListenAndServe("127.0.0.1:8080", mux)
	defer srv.Close()

	req, _ := http.NewRequest(http.MethodGet, srv.URL+"/ops/perspectives/", nil)
	req.Header.Set("Authorization", "Bearer s3cret")
	res, err := http.DefaultClient.Do(req)
	if err != nil {
		panic(err)
	}
	res.Body.Close()
	fmt.Println(res.Status)
	// Output: 200 OK
}
