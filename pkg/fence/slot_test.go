package fence_test

import (
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"agentplane.dev/pkg/fence"
	"agentplane.dev/pkg/redistest"
)

// crc16 is CRC16-CCITT (XMODEM), the hash of Redis Cluster key slots.
func crc16(b []byte) uint16 {
	var crc uint16
	for _, c := range b {
		crc ^= uint16(c) << 8
		for range 8 {
			if crc&0x8000 != 0 {
				crc = crc<<1 ^ 0x1021
			} else {
				crc <<= 1
			}
		}
	}
	return crc
}

func slot(key string) uint16 { return crc16([]byte(fence.HashTag(key))) % 16384 }

func TestCRC16KnownValue(t *testing.T) {
	require.EqualValues(t, 0x31C3, crc16([]byte("123456789"))) // Redis cluster spec
	require.Equal(t, slot("{user1000}.following"), slot("{user1000}.followers"))
}

// Every script the package sends touches keys of one hash slot.
func TestAllScriptKeysShareOneSlot(t *testing.T) {
	rdb := redistest.Universal(t)
	counter := &commandCounter{}
	rdb.AddHook(counter)

	for _, res := range []string{"a", "sandbox/7f3e", "user:42:x", "with space"} {
		l, err := fence.Acquire(ctx, rdb, res, "o", time.Minute)
		require.NoError(t, err)
		require.NoError(t, l.Renew(ctx))
		require.NoError(t, l.Guard(ctx,
			fence.Set("sbx:"+fence.Key(res, "a"), 1, 0),
			fence.HSet(fence.Key(res, "b"), "f", 1),
			fence.PExpire(fence.Key(res, "b"), time.Minute),
			fence.Del(fence.Key(res, "c"), "ses:"+fence.Key(res, "d"))))
		require.NoError(t, l.Guard(ctx, fence.HSet(fence.Key(res, "b"), "g", 2))) // one-op script
		_, err = fence.NewGuardedScript(`return 1`).Run(ctx, rdb, res, l.Token, []string{fence.Key(res, "e")}).Result()
		require.NoError(t, err)
		require.NoError(t, l.Release(ctx))
		h, err := fence.Hold(ctx, rdb, res, "o", time.Minute)
		require.NoError(t, err)
		require.NoError(t, h.Release(ctx))
	}

	scripts := map[string]bool{}
	checked := 0
	for _, c := range counter.take() {
		name := c.Name()
		if name != "evalsha" && name != "eval" {
			continue
		}
		args := c.Args()
		if name == "evalsha" { // the first call of each script is an EVAL fallback
			scripts[args[1].(string)] = true
		}
		n := int(args[2].(int))
		require.Positive(t, n)
		want := slot(args[3].(string))
		for _, k := range args[3 : 3+n] {
			require.Equal(t, want, slot(k.(string)), "%v", args)
		}
		checked++
	}
	require.Positive(t, checked)
	// acquire, renew, release, the one-op and ops scripts and the custom
	// script.
	require.Len(t, scripts, 6)
}
