package fence

// GuardPreludeForTest exposes the token check for tests that call the
// script with raw, malformed tokens.
const GuardPreludeForTest = guardPrelude
