package config

import (
	"strings"
	"testing"
)

// FuzzRedisURLErrorsHideThePassword: whatever follows the credentials of a Redis URL, a
// parse error never quotes the password (a setting's error is printed at start).
func FuzzRedisURLErrorsHideThePassword(f *testing.F) {
	for _, seed := range []string{"127.0.0.1:notaport/0", "h%zz:1/0", "h1:1,h2:2/m", "h1:1/%zz", "h:1/0?dial_timeout=x", "/run/redis.sock?db=x", "h@x:1", ""} {
		f.Add("redis", seed)
		f.Add("redis+sentinel", seed)
		f.Add("rediss+cluster", seed)
		f.Add("unix", seed)
	}
	const pw = "Pw7xQz"
	f.Fuzz(func(t *testing.T, scheme, rest string) {
		if strings.Contains(scheme+rest, pw[:3]) {
			return
		}
		for _, raw := range []string{scheme + "://:" + pw + "@" + rest, scheme + "://user:" + pw + "@" + rest} {
			if _, err := parseRedisURL(raw, ""); err != nil && strings.Contains(err.Error(), pw[:3]) {
				t.Fatalf("error quotes the password: %v", err)
			}
		}
	})
}
