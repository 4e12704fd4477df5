// Package config loads typed service configuration from AGENTPLANE_* environment variables
// and command-line flags, validated at start so a bad value fails fast with a message that
// names the variable and the flag.
//
// Every setting has one name, e.g. "REDIS_URL": the environment variable is
// AGENTPLANE_REDIS_URL and the flag is --redis-url. The environment sets the flag's default;
// a flag given on the command line wins. A secret setting (Loader.Secret) also has a file
// form, AGENTPLANE_REDIS_URL_FILE and --redis-url-file, which is how production passes it.
package config

import (
	"encoding"
	"errors"
	"flag"
	"fmt"
	"strconv"
	"strings"
	"time"
)

// EnvPrefix starts every agentplane environment variable.
const EnvPrefix = "AGENTPLANE_"

// Error is a bad setting; it names both ways to set it.
type Error struct {
	Env, Flag string
	Err       error
}

func (e *Error) Error() string { return fmt.Sprintf("%s (--%s): %v", e.Env, e.Flag, e.Err) }
func (e *Error) Unwrap() error { return e.Err }

// Loader binds settings to a flag.FlagSet with defaults taken from the environment.
type Loader struct {
	fs        *flag.FlagSet
	lookupEnv func(string) (string, bool)
	envErrs   map[string]error // by flag name; dropped when the flag is given explicitly
	secrets   []secretSetting  // bound by Secret, resolved by Parse
	plain     []PlainSecret    // secrets Parse found given as values, not files
	parsed    []func()         // run at the end of a successful Parse
}

// NewLoader binds to fs and reads the environment through lookupEnv (os.LookupEnv in main,
// a map in tests).
func NewLoader(fs *flag.FlagSet, lookupEnv func(string) (string, bool)) *Loader {
	return &Loader{fs: fs, lookupEnv: lookupEnv, envErrs: map[string]error{}}
}

// Names returns the environment variable and flag of a setting name like "REDIS_URL".
func Names(name string) (env, flagName string) {
	return EnvPrefix + name, strings.ReplaceAll(strings.ToLower(name), "_", "-")
}

// ErrorFor wraps err as a bad value of the named setting.
func ErrorFor(name string, err error) *Error {
	env, fl := Names(name)
	return &Error{Env: env, Flag: fl, Err: err}
}

// String binds *p to name with default def.
func (l *Loader) String(p *string, name, def, usage string) {
	env, fl := Names(name)
	if v, ok := l.lookupEnv(env); ok {
		def = v
	}
	l.fs.StringVar(p, fl, def, usage+" (env "+env+")")
}

// Duration binds *p to name with default def; values use time.ParseDuration syntax.
func (l *Loader) Duration(p *time.Duration, name string, def time.Duration, usage string) {
	l.Var(durationValue{p}, name, durationValue{&def}, usage)
}

// Int binds *p to name with default def.
func (l *Loader) Int(p *int, name string, def int, usage string) {
	l.Var(intValue{p}, name, intValue{&def}, usage)
}

// Bool binds *p to name with default def.
func (l *Loader) Bool(p *bool, name string, def bool, usage string) {
	l.Var(boolValue{p}, name, boolValue{&def}, usage)
}

// TextVar binds p (e.g. *slog.Level) to name with default def, through its text methods.
func (l *Loader) TextVar(p encoding.TextUnmarshaler, name string, def encoding.TextMarshaler, usage string) {
	env, fl := Names(name)
	l.fs.TextVar(p, fl, def, usage+" (env "+env+")")
	if v, ok := l.lookupEnv(env); ok {
		if err := p.UnmarshalText([]byte(v)); err != nil {
			l.envErrs[fl] = &Error{Env: env, Flag: fl, Err: fmt.Errorf("invalid value %q: %w", v, err)}
		}
	}
}

// Var binds any flag.Value; def is applied first, then the environment.
func (l *Loader) Var(v flag.Value, name string, def flag.Value, usage string) {
	env, fl := Names(name)
	_ = v.Set(def.String())
	if s, ok := l.lookupEnv(env); ok {
		if err := v.Set(s); err != nil {
			l.envErrs[fl] = &Error{Env: env, Flag: fl, Err: fmt.Errorf("invalid value %q: %w", s, err)}
		}
	}
	l.fs.Var(v, fl, usage+" (env "+env+")")
}

// Parse parses args and reports every environment value that could not be parsed (unless
// its flag was given), joined into one error. A service takes no arguments besides its
// flags: one is an error (the flags after it would otherwise be ignored).
func (l *Loader) Parse(args []string) error {
	if err := l.fs.Parse(args); err != nil {
		return err
	}
	if l.fs.NArg() > 0 {
		return fmt.Errorf("unexpected argument %q (a service takes only flags)", l.fs.Arg(0))
	}
	l.fs.Visit(func(f *flag.Flag) { delete(l.envErrs, f.Name) })
	var errs []error
	l.fs.VisitAll(func(f *flag.Flag) { // VisitAll is sorted, so the message is stable
		if err := l.envErrs[f.Name]; err != nil {
			errs = append(errs, err)
		}
	})
	errs = append(errs, l.resolveSecrets()...)
	if err := errors.Join(errs...); err != nil {
		return err
	}
	for _, f := range l.parsed {
		f()
	}
	return nil
}

type durationValue struct{ p *time.Duration }

func (d durationValue) String() string {
	if d.p == nil {
		return "0s"
	}
	return d.p.String()
}

func (d durationValue) Set(s string) error {
	v, err := time.ParseDuration(s)
	if err != nil {
		return errors.New("want a duration like 5s or 1m30s")
	}
	*d.p = v
	return nil
}

type intValue struct{ p *int }

func (i intValue) String() string {
	if i.p == nil {
		return "0"
	}
	return strconv.Itoa(*i.p)
}

func (i intValue) Set(s string) error {
	v, err := strconv.Atoi(s)
	if err != nil {
		return errors.New("want an integer")
	}
	*i.p = v
	return nil
}

type boolValue struct{ p *bool }

func (b boolValue) String() string {
	if b.p == nil {
		return "false"
	}
	return strconv.FormatBool(*b.p)
}

func (b boolValue) Set(s string) error {
	v, err := strconv.ParseBool(s)
	if err != nil {
		return errors.New("want true or false")
	}
	*b.p = v
	return nil
}

func (b boolValue) IsBoolFlag() bool { return true }
