package codecheck

import (
	"bufio"
	"bytes"
	"fmt"
	"os/exec"
	"slices"
	"strings"
)

// Transport reports whether an import path is transport: gRPC or the
// generated protos. A domain package depends on neither, directly or
// through another package (docs/architecture.md, "the one rule").
func Transport(path string) bool {
	return path == "google.golang.org/grpc" || strings.HasPrefix(path, "google.golang.org/grpc/") ||
		path == "agentplane.dev/pkg/gen" || strings.HasPrefix(path, "agentplane.dev/pkg/gen/")
}

// Crossing is a package of a module that depends on transport, with the
// edges where its dependencies first reach it: "from imports to".
type Crossing struct {
	Package string
	Edges   []string
}

// TransportCrossings lists, for the packages matching pattern in the Go
// module at dir, each one that depends on transport, and through which
// imports. It asks `go list -deps` for the import graph.
func TransportCrossings(dir, pattern string) ([]Crossing, error) {
	return Crossings(dir, pattern, Transport)
}

// Crossings lists, for the packages matching pattern in the Go module at
// dir, each one that depends on a package banned says is out of bounds, and
// through which imports.
func Crossings(dir, pattern string, banned func(path string) bool) ([]Crossing, error) {
	roots, err := goList(dir, "{{.ImportPath}}", pattern)
	if err != nil {
		return nil, err
	}
	lines, err := goList(dir, "{{.ImportPath}} {{join .Imports \" \"}}", "-deps", pattern)
	if err != nil {
		return nil, err
	}
	imports := map[string][]string{}
	for _, l := range lines {
		f := strings.Fields(l)
		imports[f[0]] = f[1:]
	}
	var out []Crossing
	for _, root := range roots {
		if edges := crossingEdges(root, imports, banned); len(edges) > 0 {
			out = append(out, Crossing{Package: root, Edges: edges})
		}
	}
	return out, nil
}

// crossingEdges walks root's dependencies and returns every edge from a
// package that is not banned to one that is.
func crossingEdges(root string, imports map[string][]string, banned func(string) bool) []string {
	var edges []string
	seen := map[string]bool{root: true}
	queue := []string{root}
	for len(queue) > 0 {
		p := queue[0]
		queue = queue[1:]
		for _, imp := range imports[p] {
			if banned(imp) {
				edges = append(edges, p+" imports "+imp)
				continue
			}
			if !seen[imp] {
				seen[imp] = true
				queue = append(queue, imp)
			}
		}
	}
	slices.Sort(edges)
	return edges
}

func goList(dir, format string, args ...string) ([]string, error) {
	cmd := exec.Command("go", append([]string{"list", "-f", format}, args...)...)
	cmd.Dir = dir
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	out, err := cmd.Output()
	if err != nil {
		return nil, fmt.Errorf("go list in %s: %w: %s", dir, err, stderr.String())
	}
	var lines []string
	sc := bufio.NewScanner(bytes.NewReader(out))
	for sc.Scan() {
		if l := strings.TrimSpace(sc.Text()); l != "" {
			lines = append(lines, l)
		}
	}
	return lines, sc.Err()
}
