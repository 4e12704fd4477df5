module agentplane.dev/tools/codecheck

go 1.26.8
