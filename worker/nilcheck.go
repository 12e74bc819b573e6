package worker

import "reflect"

// isNil reports whether v is nil, including an interface holding a nil pointer (a typed
// nil such as a nil *pgxpool.Pool passed as a DBTX), which a plain v == nil misses.
func isNil(v any) bool {
	if v == nil {
		return true
	}
	switch rv := reflect.ValueOf(v); rv.Kind() {
	case reflect.Pointer, reflect.Interface, reflect.Map, reflect.Slice, reflect.Func, reflect.Chan:
		return rv.IsNil()
	}
	return false
}
