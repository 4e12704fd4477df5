//go:build !linux

package nodump

import "errors"

// Elsewhere there is no /proc to guard and no prctl; the services run on Linux.
func set() error { return nil }

func dumpable() (bool, error) { return false, errors.New("dumpable: only known on Linux") }
