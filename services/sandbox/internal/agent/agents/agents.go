// Package agents is the sandbox service's table of agent profiles (DESIGN.md
// 3.7): named runtimes a session chooses with CreateSession.agent. A profile
// says how the wrapper drives the runtime (agentplane JSON lines or ACP),
// its command line, extra environment, the provider config file the agent
// reads and its default model. Resolve turns a session's choice into the
// Spec the wrapper is launched with; an unknown profile, or one whose
// program is not installed, is ErrUnavailable.
package agents

import (
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
)

// Protocols a profile's runtime speaks.
const (
	ProtocolJSONL = "jsonl" // agentplane's JSON lines (docs/runtime-protocol.md)
	ProtocolACP   = "acp"   // the Agent Client Protocol
)

// Built-in profile names.
const (
	Scripted = "scripted"
	OpenCode = "opencode"
	Kilo     = "kilo"
	ACP      = "acp"
)

// ErrUnavailable is an unknown or uninstalled profile.
var ErrUnavailable = errors.New("agent unavailable")

// ErrBadModel is a model name outside [A-Za-z0-9._:/-]{1,128} (it is
// written into the agent's JSON config).
var ErrBadModel = errors.New("agent model")

var modelName = regexp.MustCompile(`^[A-Za-z0-9._:/-]{1,128}$`)

// Placeholders of a config template, replaced by the wrapper when it writes
// the agent's provider config under the sandbox home. There is no
// placeholder for a credential: the file names the wrapper's loopback relay
// and a dummy key, the relay adds the current handle itself.
const (
	PlaceholderBaseURL = "{{BASE_URL}}" // the relay's OpenAI-compatible base, http://127.0.0.1:<port>/v1
	PlaceholderModel   = "{{MODEL}}"
	PlaceholderAPIKey  = "{{API_KEY}}" // a fixed dummy, never a handle
)

// opencodeConfig is the provider config opencode and Kilo take from the
// file named by OPENCODE_CONFIG / KILO_CONFIG: one OpenAI-compatible
// provider (a package built into both binaries), no other providers, no
// auto-update, no sharing.
const opencodeConfig = `{
  "provider": {
    "agentplane": {
      "npm": "@ai-sdk/openai-compatible",
      "name": "agentplane",
      "options": {"baseURL": "{{BASE_URL}}", "apiKey": "{{API_KEY}}"},
      "models": {"{{MODEL}}": {"name": "{{MODEL}}"}}
    }
  },
  "enabled_providers": ["agentplane"],
  "autoupdate": false,
  "share": "disabled",
  "model": "agentplane/{{MODEL}}"
}
`

// Profile is one configured agent.
type Profile struct {
	Name     string
	Protocol string
	// Command is the program and its arguments; empty for scripted (the
	// wrapper's own `runtime scripted`).
	Command []string
	// Env is extra environment (NAME=value), never a secret.
	Env []string
	// ConfigEnv names the variable that points the agent at its provider
	// config file; ConfigTemplate is that file's text with placeholders.
	ConfigEnv      string
	ConfigTemplate string
	Model          string
	// ExpectedDenials are hosts (exact, or "*.suffix" for its subdomains)
	// the agent is known to try on its own (telemetry, update checks)
	// whose egress denials are expected: the session service counts them
	// on one audit record per turn and host instead of one each.
	ExpectedDenials []string
	// program is Command[0] as the service sees it on the host, when the
	// sandbox shows it elsewhere (Config.Inside).
	program string
}

// hostProgram is the program Resolve checks is installed: Command[0] on
// the host.
func (p Profile) hostProgram() string {
	if p.program != "" {
		return p.program
	}
	if len(p.Command) > 0 {
		return p.Command[0]
	}
	return ""
}

// Spec is what the wrapper is launched with: the resolved profile and model.
// It holds no secret and travels in the wrapper's argv (--runtime-spec).
type Spec struct {
	Profile        string   `json:"profile"`
	Protocol       string   `json:"protocol"`
	Command        []string `json:"command,omitempty"`
	Env            []string `json:"env,omitempty"`
	ConfigEnv      string   `json:"config_env,omitempty"`
	ConfigTemplate string   `json:"config_template,omitempty"`
	Model          string   `json:"model,omitempty"`
}

// Encode is the --runtime-spec value.
func (s Spec) Encode() string {
	b, _ := json.Marshal(s)
	return string(b)
}

// ParseSpec reads a --runtime-spec value.
func ParseSpec(v string) (Spec, error) {
	var s Spec
	if err := json.Unmarshal([]byte(v), &s); err != nil {
		return Spec{}, fmt.Errorf("runtime spec: %w", err)
	}
	switch s.Protocol {
	case ProtocolJSONL:
	case ProtocolACP:
		if len(s.Command) == 0 {
			return Spec{}, errors.New("runtime spec: an acp runtime needs a command")
		}
	default:
		return Spec{}, fmt.Errorf("runtime spec: unknown protocol %q", s.Protocol)
	}
	return s, nil
}

// Config of the built-in profiles.
type Config struct {
	// Dir is where the pinned agents are installed (the directory holding
	// node_modules: `make agents` installs into agents/); empty: opencode
	// and kilo are unavailable.
	Dir string
	// Inside is where Dir appears to the runtime (the sandbox binds it at
	// boundary.InnerAgents); empty: at Dir itself (no boundary).
	Inside string
	// ACPCommand is the generic acp profile's command line; empty: the
	// profile is unavailable.
	ACPCommand []string
	// Model is the default model of the ACP profiles.
	Model string
	// Default is the profile of a session that names none.
	Default string
	// ExpectedDenials adds hosts to profiles' expected denials, by profile
	// name (AGENT_EXPECTED_DENIALS; ParseExpectedDenials).
	ExpectedDenials map[string][]string
}

// Registry resolves profiles.
type Registry struct {
	profiles map[string]Profile
	def      string
}

// New builds the built-in profiles from cfg.
func New(cfg Config) *Registry {
	if cfg.Model == "" {
		cfg.Model = "default"
	}
	if cfg.Default == "" {
		cfg.Default = Scripted
	}
	r := &Registry{profiles: map[string]Profile{Scripted: {Name: Scripted, Protocol: ProtocolJSONL}}, def: cfg.Default}
	if cfg.Dir != "" {
		// The native builds themselves (no node launcher): inside the
		// sandbox boundary only this directory needs binding read-only.
		inside := cfg.Inside
		if inside == "" {
			inside = cfg.Dir
		}
		oc, kilo := OpenCodeBinary(inside), KiloBinary(inside)
		r.profiles[OpenCode] = Profile{Name: OpenCode, Protocol: ProtocolACP, Command: []string{oc, "acp"}, program: OpenCodeBinary(cfg.Dir),
			Env:       offline("OPENCODE", "MODELS_FETCH", "DEFAULT_PLUGINS", "LSP_DOWNLOAD", "AUTOUPDATE", "SHARE"),
			ConfigEnv: "OPENCODE_CONFIG", ConfigTemplate: opencodeConfig, Model: cfg.Model,
			// Its start-up version check, whatever OPENCODE_DISABLE_AUTOUPDATE says.
			ExpectedDenials: []string{"registry.npmjs.org"}}
		r.profiles[Kilo] = Profile{Name: Kilo, Protocol: ProtocolACP, Command: []string{kilo, "acp"}, program: KiloBinary(cfg.Dir),
			// What Kilo's node launcher would set: its tree-sitter grammars.
			Env: append(offline("KILO", "MODELS_FETCH", "DEFAULT_PLUGINS", "LSP_DOWNLOAD", "AUTOUPDATE", "SHARE",
				"SESSION_INGEST", "PRESENCE", "CODEBASE_INDEXING"),
				"KILO_TREE_SITTER_WASM_DIR="+filepath.Join(filepath.Dir(kilo), "tree-sitter")),
			ConfigEnv: "KILO_CONFIG", ConfigTemplate: opencodeConfig, Model: cfg.Model,
			// Its telemetry (PostHog) on every turn and the version check.
			ExpectedDenials: []string{"us.i.posthog.com", "registry.npmjs.org"}}
	}
	if len(cfg.ACPCommand) > 0 {
		r.profiles[ACP] = Profile{Name: ACP, Protocol: ProtocolACP, Command: cfg.ACPCommand, Model: cfg.Model}
	}
	for name, hosts := range cfg.ExpectedDenials {
		if p, ok := r.profiles[name]; ok {
			p.ExpectedDenials = append(slices.Clip(p.ExpectedDenials), hosts...)
			r.profiles[name] = p
		}
	}
	return r
}

// ExpectsDenial reports whether profile ("": the default) names host as
// one whose egress denials are expected.
func (r *Registry) ExpectsDenial(profile, host string) bool {
	if profile == "" {
		profile = r.def
	}
	p, ok := r.profiles[profile]
	if !ok {
		return false
	}
	host = strings.ToLower(strings.TrimSuffix(host, "."))
	for _, h := range p.ExpectedDenials {
		if suffix, ok := strings.CutPrefix(h, "*."); ok {
			if strings.HasSuffix(host, "."+suffix) {
				return true
			}
		} else if host == h {
			return true
		}
	}
	return false
}

var expectedHost = regexp.MustCompile(`^(\*\.)?[a-z0-9]([a-z0-9-]{0,62}[a-z0-9])?(\.[a-z0-9]([a-z0-9-]{0,62}[a-z0-9])?)*$`)

// ParseExpectedDenials reads AGENT_EXPECTED_DENIALS: profile=host|host
// pairs, comma separated (kilo=us.i.posthog.com|*.sentry.io,scripted=telemetry.example);
// a host is a lower-case DNS name, or "*." and one for its subdomains.
// Empty: none.
func ParseExpectedDenials(s string) (map[string][]string, error) {
	out := map[string][]string{}
	for pair := range strings.SplitSeq(s, ",") {
		pair = strings.TrimSpace(pair)
		if pair == "" {
			continue
		}
		name, hosts, ok := strings.Cut(pair, "=")
		if !ok || name == "" || hosts == "" {
			return nil, fmt.Errorf("%q: want profile=host|host", pair)
		}
		for h := range strings.SplitSeq(hosts, "|") {
			if len(h) > 253 || !expectedHost.MatchString(h) {
				return nil, fmt.Errorf("%q: %q is not a lower-case host name (or *.name)", pair, h)
			}
			out[name] = append(out[name], h)
		}
	}
	return out, nil
}

// offline turns off what the agent would otherwise fetch or send over the
// network on its own (model lists, plugins, language servers, updates,
// sharing, telemetry-like presence): inside the sandbox only the proxy is
// reachable, and each attempt would only stall the agent's start.
func offline(prefix string, features ...string) []string {
	out := make([]string, 0, len(features))
	for _, f := range features {
		out = append(out, prefix+"_DISABLE_"+f+"=1")
	}
	return out
}

// EgressEnv is the environment that sends a runtime's outbound HTTP(S)
// through the egress proxy at proxyURL: both spellings of each variable
// (curl reads only the lower-case http_proxy; Node, Python, Go and git
// read either), and NO_PROXY for the sandbox's own loopback, where the
// credential proxy (credentialAddr) and the provider relay live.
// NODE_USE_ENV_PROXY makes Node's built-in fetch honour them too.
func EgressEnv(proxyURL, credentialAddr string) []string {
	noProxy := "localhost,127.0.0.1,::1"
	if credentialAddr != "" {
		noProxy += "," + credentialAddr
	}
	var env []string
	for _, k := range []string{"HTTP_PROXY", "HTTPS_PROXY"} {
		env = append(env, k+"="+proxyURL, strings.ToLower(k)+"="+proxyURL)
	}
	return append(env, "NO_PROXY="+noProxy, "no_proxy="+noProxy, "NODE_USE_ENV_PROXY=1")
}

// OpenCodeBinary and KiloBinary are where `make agents` (npm ci in
// agents/) puts the pinned linux-x64 builds under dir.
func OpenCodeBinary(dir string) string {
	return filepath.Join(dir, "node_modules", "opencode-linux-x64", "bin", "opencode")
}

// KiloBinary: see OpenCodeBinary.
func KiloBinary(dir string) string {
	return filepath.Join(dir, "node_modules", "@kilocode", "cli-linux-x64", "bin", "kilo")
}

// Names lists the configured profiles.
func (r *Registry) Names() []string {
	out := make([]string, 0, len(r.profiles))
	for n := range r.profiles {
		out = append(out, n)
	}
	slices.Sort(out)
	return out
}

// Resolve returns the launch spec of profile (empty: the default) with model
// (empty: the profile's default). It fails with ErrUnavailable for an
// unknown profile or one whose program is not an executable file.
func (r *Registry) Resolve(profile, model string) (Spec, error) {
	if profile == "" {
		profile = r.def
	}
	p, ok := r.profiles[profile]
	if !ok {
		return Spec{}, fmt.Errorf("%w: no profile %q (configured: %s)", ErrUnavailable, profile, strings.Join(r.Names(), ", "))
	}
	if program := p.hostProgram(); program != "" {
		if err := executable(program); err != nil {
			return Spec{}, fmt.Errorf("%w: profile %q is not installed: %w", ErrUnavailable, profile, err)
		}
	}
	if model == "" {
		model = p.Model
	}
	if (model != "" || p.Protocol == ProtocolACP) && !modelName.MatchString(model) {
		return Spec{}, fmt.Errorf("%w: bad model name", ErrBadModel)
	}
	return Spec{Profile: p.Name, Protocol: p.Protocol, Command: p.Command, Env: p.Env,
		ConfigEnv: p.ConfigEnv, ConfigTemplate: p.ConfigTemplate, Model: model}, nil
}

func executable(path string) error {
	st, err := os.Stat(path)
	if err != nil {
		return errors.New("program not found")
	}
	if st.IsDir() || st.Mode()&0o111 == 0 {
		return errors.New("program is not executable")
	}
	return nil
}

// Render fills a config template.
func Render(template, baseURL, model, apiKey string) string {
	return strings.NewReplacer(PlaceholderBaseURL, baseURL, PlaceholderModel, model, PlaceholderAPIKey, apiKey).Replace(template)
}
