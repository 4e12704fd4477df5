// Package codecheck holds checks over the repository's own source that no
// linter here makes: today, the length of functions in services/.
package codecheck

import (
	"go/ast"
	"go/parser"
	"go/token"
	"io/fs"
	"path/filepath"
	"strings"
)

// Func is one function declaration and its length in lines, from its
// signature to its closing brace.
type Func struct {
	Name  string // path/to/file.go:Recv.Name or path/to/file.go:Name, path relative to the walked root's parent
	Lines int
}

// LongFuncs lists the functions over max lines in the non-test,
// non-generated Go files under dir. Names are relative to base.
func LongFuncs(base, dir string, max int) ([]Func, error) {
	var long []Func
	err := filepath.WalkDir(dir, func(path string, d fs.DirEntry, err error) error {
		if err != nil || d.IsDir() || !strings.HasSuffix(path, ".go") || strings.HasSuffix(path, "_test.go") {
			return err
		}
		fset := token.NewFileSet()
		f, err := parser.ParseFile(fset, path, nil, parser.ParseComments|parser.SkipObjectResolution)
		if err != nil {
			return err
		}
		if ast.IsGenerated(f) {
			return nil
		}
		rel, err := filepath.Rel(base, path)
		if err != nil {
			return err
		}
		for _, decl := range f.Decls {
			fn, ok := decl.(*ast.FuncDecl)
			if !ok || fn.Body == nil {
				continue
			}
			n := fset.Position(fn.End()).Line - fset.Position(fn.Pos()).Line + 1
			if n > max {
				long = append(long, Func{Name: filepath.ToSlash(rel) + ":" + funcName(fn), Lines: n})
			}
		}
		return nil
	})
	return long, err
}

func funcName(fn *ast.FuncDecl) string {
	if fn.Recv == nil || len(fn.Recv.List) == 0 {
		return fn.Name.Name
	}
	t := fn.Recv.List[0].Type
	if s, ok := t.(*ast.StarExpr); ok {
		t = s.X
	}
	switch x := t.(type) {
	case *ast.IndexExpr:
		t = x.X
	case *ast.IndexListExpr:
		t = x.X
	}
	if id, ok := t.(*ast.Ident); ok {
		return id.Name + "." + fn.Name.Name
	}
	return fn.Name.Name
}
