// Command hostile is a wrapper binary whose runtime attacks its boundary
// (server/boundary_test.go). `hostile wrapper ...` is the real wrapper;
// `hostile runtime scripted` (what the wrapper starts) runs the real
// scripted runtime as a child, relaying its stdio, and on the first
// open_route tries everything a hostile runtime would, leaves background
// processes behind, and writes what happened to hostile-report.json in its
// working directory. targets.json there names what to attack.
package main

import (
	"bufio"
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"net"
	"net/http"
	"os"
	"os/exec"
	"strings"
	"syscall"
	"time"

	"agentplane.dev/services/sandbox/runtime/scripted"
	"agentplane.dev/services/sandbox/wrapper"
)

// Targets are what the test points the runtime at.
type Targets struct {
	PIDs  []int    `json:"pids"`  // host pids: a service (the test process), another sandbox's wrapper
	Files []string `json:"files"` // host paths: another sandbox's file, the sandbox root's files
	Addrs []string `json:"addrs"` // host loopback: Redis, a service's gRPC port, an HTTP server
	Leak  bool     `json:"leak"`  // start background processes that try to outlive the runtime
	// Supervisor: go after the wrapper from inside, as a runtime would:
	// every process it can see, their environ and memory, SIGSTOP to any
	// that is a wrapper; report to supervisor-report.json.
	Supervisor bool `json:"supervisor"`
}

func main() {
	if len(os.Args) > 2 && os.Args[1] == "runtime" && os.Args[2] == "scripted" {
		os.Exit(hostile())
	}
	if len(os.Args) > 2 && os.Args[1] == "runtime" && os.Args[2] == "real" {
		os.Exit(scripted.Main(os.Args[3:]))
	}
	if code, ok := wrapper.Subcommand(os.Args[1:]); ok {
		os.Exit(code)
	}
	os.Exit(2)
}

func hostile() int {
	self, err := os.Executable()
	if err != nil {
		return 1
	}
	child := exec.Command(self, "runtime", "real")
	child.Stdout, child.Stderr = os.Stdout, os.Stderr
	in, err := child.StdinPipe()
	if err != nil || child.Start() != nil {
		return 1
	}
	// No targets.json where it starts: nothing was written for a sandbox,
	// so this is a pooled runtime, started before its wrapper's claim. It
	// attacks its supervisor now, bound to no sandbox yet.
	if _, err := os.Stat("targets.json"); errors.Is(err, fs.ErrNotExist) {
		supervisor()
	}
	sc := bufio.NewScanner(os.Stdin)
	sc.Buffer(make([]byte, 1<<20), 1<<20)
	attacked := false
	for sc.Scan() {
		line := sc.Bytes()
		var f struct {
			Type     string `json:"type"`
			ProxyURL string `json:"proxy_url"`
		}
		if !attacked && json.Unmarshal(line, &f) == nil && f.Type == "open_route" {
			attacked = true
			attack(f.ProxyURL)
		}
		if _, err := in.Write(append(append([]byte{}, line...), '\n')); err != nil {
			break
		}
	}
	_ = in.Close()
	_ = child.Wait()
	return 0
}

func result(err error) string {
	if err == nil {
		return "ok"
	}
	return "failed: " + err.Error()
}

func attack(proxyURL string) {
	report := map[string]string{}
	var t Targets
	if b, err := os.ReadFile("targets.json"); err == nil {
		_ = json.Unmarshal(b, &t)
	}
	for _, pid := range t.PIDs {
		for _, f := range []string{"environ", "mem", "cmdline"} {
			_, err := os.ReadFile(fmt.Sprintf("/proc/%d/%s", pid, f))
			report[fmt.Sprintf("read /proc/%d/%s", pid, f)] = result(err)
		}
		report[fmt.Sprintf("signal %d", pid)] = result(syscall.Kill(pid, syscall.SIGTERM))
	}
	for _, p := range append(t.Files, "/etc/shadow") {
		_, err := os.ReadFile(p)
		report["read "+p] = result(err)
	}
	report["write /usr"] = result(os.WriteFile("/usr/hostile", []byte("x"), 0o644))
	for _, a := range t.Addrs {
		c, err := net.DialTimeout("tcp", a, 2*time.Second)
		if err == nil {
			_ = c.Close()
		}
		report["connect "+a] = result(err)
	}
	// Another interface's address, in case loopback alone were closed.
	if c, err := net.DialTimeout("tcp", "1.1.1.1:443", 2*time.Second); err == nil {
		_ = c.Close()
		report["connect 1.1.1.1:443"] = "ok"
	} else {
		report["connect 1.1.1.1:443"] = result(err)
	}
	var lim syscall.Rlimit
	if err := syscall.Getrlimit(syscall.RLIMIT_NOFILE, &lim); err == nil {
		report["rlimit nofile"] = fmt.Sprint(lim.Cur, "/", lim.Max)
		report["raise rlimit nofile"] = result(syscall.Setrlimit(syscall.RLIMIT_NOFILE, &syscall.Rlimit{Cur: lim.Max + 1, Max: lim.Max + 1}))
	}
	report["raise rlimit nproc"] = result(syscall.Setrlimit(6, &syscall.Rlimit{Cur: ^uint64(0), Max: ^uint64(0)}))
	report["uid"] = fmt.Sprint(os.Getuid())
	report["proxy"] = fetch(proxyURL + "/provider/v1/messages")
	if t.Supervisor {
		supervisor()
	}
	if t.Leak {
		// Background, own session, double fork, no environment: each tries
		// to outlive the runtime.
		report["leak"] = result(exec.Command("/bin/sh", "-c",
			"sleep 600 & setsid sleep 600 & (sleep 600 &) ; env -i sleep 600 &").Run())
	}
	b, _ := json.MarshalIndent(report, "", "  ")
	_ = os.WriteFile("hostile-report.json.tmp", b, 0o644)
	_ = os.Rename("hostile-report.json.tmp", "hostile-report.json")
}

func fetch(url string) string {
	if url == "" || strings.HasPrefix(url, "/") {
		return "failed: no proxy_url"
	}
	c := &http.Client{Timeout: 10 * time.Second}
	resp, err := c.Get(url)
	if err != nil {
		return result(err)
	}
	defer resp.Body.Close()
	body, err := io.ReadAll(io.LimitReader(resp.Body, 1<<16))
	if err != nil {
		return result(err)
	}
	if resp.StatusCode != http.StatusOK {
		return result(errors.New(resp.Status))
	}
	return "ok: " + string(body)
}

// SupervisorReport is what a runtime learned about its wrapper.
type SupervisorReport struct {
	Self    int               `json:"self"`
	Parent  string            `json:"parent"`  // the parent's cmdline
	Visible map[int]string    `json:"visible"` // every other pid it can see: its cmdline
	Environ map[int]string    `json:"environ"` // reading each one's environ: ok or the error
	Mem     map[int]string    `json:"mem"`     // reading each one's memory: ok or the error
	Cred    []int             `json:"cred"`    // pids whose environ or memory holds a launch credential
	Stop    map[int]string    `json:"stop"`    // SIGSTOP to each visible wrapper
	Errors  map[string]string `json:"errors"`
}

func supervisor() {
	// The credential's prefix, made at run time so that it is in no
	// process's memory but this one's, which is not searched.
	needle := []byte(strings.ToLower("APLC") + "_")
	rep := SupervisorReport{Self: os.Getpid(), Visible: map[int]string{}, Environ: map[int]string{}, Mem: map[int]string{},
		Stop: map[int]string{}, Errors: map[string]string{}}
	if b, err := os.ReadFile(fmt.Sprintf("/proc/%d/cmdline", os.Getppid())); err == nil {
		rep.Parent = strings.ReplaceAll(string(b), "\x00", " ")
	} else {
		rep.Parent = result(err)
	}
	ents, err := os.ReadDir("/proc")
	if err != nil {
		rep.Errors["list /proc"] = err.Error()
	}
	for _, e := range ents {
		var pid int
		if _, err := fmt.Sscanf(e.Name(), "%d", &pid); err != nil || pid == rep.Self {
			continue
		}
		cmd, _ := os.ReadFile(fmt.Sprintf("/proc/%d/cmdline", pid))
		rep.Visible[pid] = strings.ReplaceAll(string(cmd), "\x00", " ")
		env, err := os.ReadFile(fmt.Sprintf("/proc/%d/environ", pid))
		rep.Environ[pid] = result(err)
		found := bytes.Contains(env, needle)
		mem, err := readMemory(pid, 64<<20)
		rep.Mem[pid] = result(err)
		if found || bytes.Contains(mem, needle) {
			rep.Cred = append(rep.Cred, pid)
		}
		if args := strings.Split(string(cmd), "\x00"); len(args) > 1 && args[1] == "wrapper" {
			rep.Stop[pid] = result(syscall.Kill(pid, syscall.SIGSTOP))
			_ = syscall.Kill(pid, syscall.SIGCONT) // let the turn go on where the stop worked
		}
	}
	b, _ := json.MarshalIndent(rep, "", "  ")
	_ = os.WriteFile("supervisor-report.json.tmp", b, 0o644)
	_ = os.Rename("supervisor-report.json.tmp", "supervisor-report.json")
}

// readMemory reads a process's anonymous and heap mappings (where a Go
// program keeps its strings) through /proc/<pid>/mem, up to limit bytes.
func readMemory(pid int, limit int) ([]byte, error) {
	maps, err := os.ReadFile(fmt.Sprintf("/proc/%d/maps", pid))
	if err != nil {
		return nil, err
	}
	f, err := os.Open(fmt.Sprintf("/proc/%d/mem", pid))
	if err != nil {
		return nil, err
	}
	defer f.Close()
	var out []byte
	var firstErr error
	for _, line := range strings.Split(string(maps), "\n") {
		fields := strings.Fields(line)
		if len(fields) < 5 || fields[1][0] != 'r' || len(fields) > 5 && fields[5] != "[heap]" {
			continue
		}
		var start, end uint64
		if _, err := fmt.Sscanf(fields[0], "%x-%x", &start, &end); err != nil {
			continue
		}
		for off := start; off < end && len(out) < limit; off += 1 << 20 {
			buf := make([]byte, min(1<<20, end-off))
			n, err := f.ReadAt(buf, int64(off))
			if err != nil && n == 0 {
				if firstErr == nil {
					firstErr = err
				}
				break
			}
			out = append(out, buf[:n]...)
		}
	}
	if len(out) == 0 && firstErr != nil {
		return nil, firstErr
	}
	return out, nil
}
