module agentplane.dev/cmd/agentplane

go 1.26.8

require (
	agentplane.dev/pkg v0.0.0
	agentplane.dev/services/credential v0.0.0
	agentplane.dev/services/ingest v0.0.0
	agentplane.dev/services/sandbox v0.0.0
	agentplane.dev/services/session v0.0.0
)

replace (
	agentplane.dev/pkg => ../../pkg
	agentplane.dev/services/credential => ../../services/credential
	agentplane.dev/services/ingest => ../../services/ingest
	agentplane.dev/services/sandbox => ../../services/sandbox
	agentplane.dev/services/session => ../../services/session
)
