package config

import (
	"errors"
	"fmt"
	"net/url"
	"strings"
	"time"

	"github.com/redis/go-redis/v9"
	"github.com/redis/go-redis/v9/maintnotifications"
)

// Redis returns a client for rawURL. Accepted forms:
//
//	redis://[user:pass@]host:port[/db][?options]       one node (redis.ParseURL)
//	rediss://...                                       one node over TLS
//	unix://[user:pass@]/path/to/redis.sock[?db=N]      one node on a Unix socket
//	redis+sentinel://[user:pass@]h1:p1,h2:p2/master[/db][?options]
//	                                                   Sentinel: the listed sentinels, master
//	                                                   name as the first path element; the
//	                                                   credentials are the master's
//	redis+cluster://[user:pass@]h1:p1,h2:p2[?options]  Cluster seed nodes
//	rediss+sentinel://, rediss+cluster://              the same over TLS
//
// Options are go-redis' snake_case query parameters (dial_timeout=3s, max_retries=5, ...).
// A Cluster URL also takes cluster_reload_interval (default DefaultClusterReload): how old
// the slot map may get before a call reloads it; the client reloads it at once, besides,
// when a node stops answering or the cluster reports a failover (reloadOnFailover).
// The client is created without I/O; readiness is the gRPC health check's business. Every
// client honours context deadlines on the socket (ContextTimeoutEnabled), so a caller's
// bound holds even when Redis is paused rather than down.
func Redis(rawURL string) (redis.UniversalClient, error) {
	newClient, err := parseRedisURL(rawURL, "")
	if err != nil {
		return nil, err
	}
	return newClient(), nil
}

// parseRedisURL parses rawURL; a non-empty password replaces the URL's. Its errors never
// quote the URL, which may carry a password.
func parseRedisURL(rawURL, password string) (func() redis.UniversalClient, error) {
	newClient, err := parseRedisURLQuoting(rawURL, password)
	var ue *url.Error
	if errors.As(err, &ue) {
		err = fmt.Errorf("invalid URL: %w", ue.Err)
	}
	return newClient, err
}

// redisURLHasUserinfo reports whether rawURL carries a user or password.
func redisURLHasUserinfo(rawURL string) bool {
	_, rest, _ := strings.Cut(rawURL, "://")
	if i := strings.IndexAny(rest, "/?"); i >= 0 {
		rest = rest[:i]
	}
	return strings.Contains(rest, "@")
}

func parseRedisURLQuoting(rawURL, password string) (func() redis.UniversalClient, error) {
	scheme, rest, ok := strings.Cut(rawURL, "://")
	if !ok {
		return nil, errors.New("want a URL like redis://host:port")
	}
	switch scheme {
	case "redis", "rediss", "unix":
		o, err := redis.ParseURL(rawURL)
		if err != nil {
			return nil, err
		}
		if password != "" {
			o.Password = password
		}
		o.ContextTimeoutEnabled = true
		o.MaintNotificationsConfig = noMaintNotifications()
		return func() redis.UniversalClient { return redis.NewClient(o) }, nil

	case "redis+sentinel", "rediss+sentinel":
		base, path, err := multiHostURL(strings.TrimSuffix(scheme, "+sentinel"), rest)
		if err != nil {
			return nil, err
		}
		master, db, _ := strings.Cut(strings.Trim(path, "/"), "/")
		if master == "" {
			return nil, errors.New("sentinel URL needs the master name as its path: redis+sentinel://h1:p1,h2:p2/mymaster")
		}
		base.Path = "/" + db
		q := base.Query()
		q.Set("master_name", master)
		base.RawQuery = q.Encode()
		o, err := redis.ParseFailoverURL(base.String())
		if err != nil {
			return nil, err
		}
		// The URL's credentials are for the master: sentinels commonly run without auth,
		// and sending AUTH to a sentinel that has none fails the connection.
		o.Username, o.Password = o.SentinelUsername, o.SentinelPassword
		o.SentinelUsername, o.SentinelPassword = "", ""
		if password != "" {
			o.Password = password
		}
		o.ContextTimeoutEnabled = true // (go-redis keeps maintenance notifications off for Sentinel)
		return func() redis.UniversalClient { return redis.NewFailoverClient(o) }, nil

	case "redis+cluster", "rediss+cluster":
		base, path, err := multiHostURL(strings.TrimSuffix(scheme, "+cluster"), rest)
		if err != nil {
			return nil, err
		}
		if strings.Trim(path, "/") != "" {
			return nil, errors.New("cluster URL takes no path (Cluster has only db 0)")
		}
		reload := DefaultClusterReload
		q := base.Query()
		if v := q.Get("cluster_reload_interval"); v != "" {
			d, err := time.ParseDuration(v)
			if err != nil || d <= 0 {
				return nil, fmt.Errorf("cluster_reload_interval=%q: want a positive duration", v)
			}
			reload = d
			q.Del("cluster_reload_interval")
			base.RawQuery = q.Encode()
		}
		o, err := redis.ParseClusterURL(base.String())
		if err != nil {
			return nil, err
		}
		if password != "" {
			o.Password = password
		}
		o.ContextTimeoutEnabled = true
		o.MaintNotificationsConfig = noMaintNotifications()
		o.ClusterStateReloadInterval = reload
		return func() redis.UniversalClient {
			cc := redis.NewClusterClient(o)
			cc.AddHook(&reloadOnFailover{cc: cc})
			return cc
		}, nil

	default:
		return nil, fmt.Errorf("unsupported scheme %q (want redis, rediss, unix, redis+sentinel or redis+cluster)", scheme)
	}
}

// multiHostURL turns "[userinfo@]h1:p1,h2:p2[/path][?query]" into a single-host URL with the
// other hosts as addr= parameters, the form go-redis' ParseFailoverURL and ParseClusterURL
// take, and returns the path separately.
func multiHostURL(scheme, rest string) (*url.URL, string, error) {
	authority, tail := rest, ""
	if i := strings.IndexAny(rest, "/?"); i >= 0 {
		authority, tail = rest[:i], rest[i:]
	}
	userinfo := ""
	if i := strings.LastIndex(authority, "@"); i >= 0 {
		userinfo, authority = authority[:i+1], authority[i+1:]
	}
	var hosts []string
	for h := range strings.SplitSeq(authority, ",") {
		if h = strings.TrimSpace(h); h != "" {
			hosts = append(hosts, h)
		}
	}
	if len(hosts) == 0 {
		return nil, "", errors.New("want at least one host:port")
	}
	u, err := url.Parse(scheme + "://" + userinfo + hosts[0] + tail)
	if err != nil {
		return nil, "", err
	}
	q := u.Query()
	for _, h := range hosts[1:] {
		q.Add("addr", h)
	}
	u.RawQuery = q.Encode()
	path := u.Path
	u.Path = ""
	return u, path, nil
}

// noMaintNotifications turns off go-redis' maintenance notifications, a Redis Enterprise/Cloud
// feature the supported deployments (standalone, Sentinel, Cluster) do not send; left on
// ("auto"), it also starts a background goroutine that Close does not stop.
func noMaintNotifications() *maintnotifications.Config {
	return &maintnotifications.Config{Mode: maintnotifications.ModeDisabled}
}
