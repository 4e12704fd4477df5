package server

import (
	"errors"
	"strconv"
	"strings"
)

// ByteSize is a size setting: plain bytes or a number with a binary unit
// (KiB, MiB, GiB, TiB), e.g. "2GiB".
type ByteSize uint64

var byteUnits = []struct {
	suffix string
	shift  uint
}{{"TiB", 40}, {"GiB", 30}, {"MiB", 20}, {"KiB", 10}, {"B", 0}}

// Set parses s.
func (b *ByteSize) Set(s string) error {
	s = strings.TrimSpace(s)
	shift := uint(0)
	for _, u := range byteUnits {
		if num, ok := strings.CutSuffix(s, u.suffix); ok {
			s, shift = strings.TrimSpace(num), u.shift
			break
		}
	}
	n, err := strconv.ParseUint(s, 10, 64)
	if err != nil {
		return errors.New("want bytes or a whole number with KiB, MiB, GiB or TiB")
	}
	if shift > 0 && n > (^uint64(0))>>shift {
		return errors.New("too large")
	}
	*b = ByteSize(n << shift)
	return nil
}

// String prints the size in the largest unit that divides it.
func (b ByteSize) String() string {
	for _, u := range byteUnits[:4] {
		if b != 0 && uint64(b)%(1<<u.shift) == 0 {
			return strconv.FormatUint(uint64(b)>>u.shift, 10) + u.suffix
		}
	}
	return strconv.FormatUint(uint64(b), 10)
}
