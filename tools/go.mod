module agentplane.dev/tools

go 1.26.8
