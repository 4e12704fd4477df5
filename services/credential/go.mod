module agentplane.dev/services/credential

go 1.26.8

require agentplane.dev/pkg v0.0.0

replace agentplane.dev/pkg => ../../pkg
