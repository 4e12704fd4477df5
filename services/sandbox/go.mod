module agentplane.dev/services/sandbox

go 1.26.8

require agentplane.dev/pkg v0.0.0

replace agentplane.dev/pkg => ../../pkg
