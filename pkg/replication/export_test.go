package replication

// IsWrite reports whether the hook confirms the command name.
func IsWrite(name string) bool { return writes[name] }
