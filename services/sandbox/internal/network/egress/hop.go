package egress

import (
	"net/http"
	"net/textproto"
	"strings"
)

// hopByHop are the headers of one connection (RFC 9110 7.6.1) and the
// proxy's own: none is forwarded.
var hopByHop = []string{"Connection", "Proxy-Connection", "Keep-Alive", "Proxy-Authenticate", "Proxy-Authorization",
	"Te", "Trailer", "Transfer-Encoding", "Upgrade"}

// dropHopByHop removes from h the hop-by-hop headers and every header the
// Connection headers name (a client can mark any header hop-by-hop: it
// ends at this proxy, never at the upstream).
func dropHopByHop(h http.Header) {
	for _, v := range h.Values("Connection") {
		for name := range strings.SplitSeq(v, ",") {
			if name = textproto.TrimString(name); name != "" {
				h.Del(name)
			}
		}
	}
	for _, name := range hopByHop {
		h.Del(name)
	}
}
