package config

import (
	"bytes"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
)

// FileSuffix names the file form of a secret setting: INTERNAL_TOKEN is read from the file
// AGENTPLANE_INTERNAL_TOKEN_FILE (--internal-token-file) names.
const FileSuffix = "_FILE"

// maxSecretFile bounds a secret file: a larger one is the wrong file, not a secret.
const maxSecretFile = 64 << 10

// secretSetting is one setting bound by Loader.Secret, resolved in Parse.
type secretSetting struct {
	name string
	p    *string
	def  string
}

// PlainSecret is a secret setting given as a value rather than as a file: its environment
// variable or flag is readable by more than the service (orchestrators show the environment,
// every local user sees a command line), so the service warns about it at start.
type PlainSecret struct {
	Name   string // setting name, e.g. "INTERNAL_TOKEN"
	OnFlag bool   // given as --flag (else as AGENTPLANE_ variable)
}

// Warning is the start-up warning for a plain secret. It names the setting, never the value.
func (s PlainSecret) Warning() string {
	env, fl := Names(s.Name)
	if s.OnFlag {
		return fmt.Sprintf("secret --%s is given on the command line, which every process on the host can read: pass --%s-file instead", fl, fl)
	}
	return fmt.Sprintf("secret %s is given in the environment: set %s%s to a file holding it instead", env, env, FileSuffix)
}

// Secret binds a secret setting: the value itself (AGENTPLANE_<NAME>, --<name>) or, the
// preferred form, a file holding it (AGENTPLANE_<NAME>_FILE, --<name>-file). Parse reads the
// file; a command-line form wins over an environment form, and giving both the value and the
// file at the same level is an error. Unlike String, the environment never becomes the
// flag's default, so -h does not print the value.
func (l *Loader) Secret(p *string, name, def, usage string) {
	env, fl := Names(name)
	l.fs.StringVar(p, fl, "", usage+" (env "+env+"; prefer --"+fl+"-file)")
	var path string
	l.fs.StringVar(&path, fl+"-file", "", "file holding the "+usage+" (env "+env+FileSuffix+"); trailing newlines are ignored")
	l.secrets = append(l.secrets, secretSetting{name: name, p: p, def: def})
}

// resolveSecrets runs after flag parsing: it picks each secret's source and reads files.
func (l *Loader) resolveSecrets() []error {
	given := map[string]bool{}
	l.fs.Visit(func(f *flag.Flag) { given[f.Name] = true })
	var errs []error
	for _, s := range l.secrets {
		env, fl := Names(s.name)
		fileEnv, fileFlag := env+FileSuffix, fl+"-file"
		pathFlag := l.fs.Lookup(fileFlag).Value.String()
		both := func(value, file string) error {
			return &Error{Env: env, Flag: fl, Err: fmt.Errorf("give either %s or %s, not both", value, file)}
		}
		switch {
		case given[fl] && given[fileFlag]:
			errs = append(errs, both("--"+fl, "--"+fileFlag))
		case given[fileFlag]:
			errs = append(errs, l.readSecretInto(s, pathFlag))
		case given[fl]:
			if *s.p != "" {
				l.plain = append(l.plain, PlainSecret{Name: s.name, OnFlag: true})
			}
		default:
			v, _ := l.lookupEnv(env)
			path, _ := l.lookupEnv(fileEnv)
			switch {
			case v != "" && path != "":
				errs = append(errs, both(env, fileEnv))
			case path != "":
				errs = append(errs, l.readSecretInto(s, path))
			case v != "":
				*s.p = v
				l.plain = append(l.plain, PlainSecret{Name: s.name})
			default:
				*s.p = s.def
			}
		}
	}
	return errs
}

func (l *Loader) readSecretInto(s secretSetting, path string) error {
	v, err := ReadSecretFile(path)
	if err != nil {
		return ErrorFor(s.name+FileSuffix, err)
	}
	*s.p = v
	return nil
}

// PlainSecrets lists the secret settings Parse found given as values rather than files.
func (l *Loader) PlainSecrets() []PlainSecret { return l.plain }

// ReadSecretFile reads a secret from path: trailing newlines are dropped, as editors and
// `echo` add one; a missing, unreadable, empty or oversized file is an error. The
// error names the path and never the content.
func ReadSecretFile(path string) (string, error) {
	if path == "" {
		return "", errors.New("empty path")
	}
	f, err := os.Open(path)
	if err != nil {
		return "", fmt.Errorf("cannot read the secret file: %w", err)
	}
	defer f.Close()
	b, err := io.ReadAll(io.LimitReader(f, maxSecretFile+1))
	if err != nil {
		return "", fmt.Errorf("cannot read the secret file: %w", err)
	}
	if len(b) > maxSecretFile {
		return "", fmt.Errorf("secret file %s is larger than %d KiB", path, maxSecretFile>>10)
	}
	b = bytes.TrimRight(b, "\r\n")
	if len(b) == 0 {
		return "", fmt.Errorf("secret file %s is empty", path)
	}
	return string(b), nil
}
