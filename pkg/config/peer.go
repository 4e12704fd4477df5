package config

import (
	"errors"

	"agentplane.dev/pkg/grpcclient"
)

// PeerAddrHelp is the usage text of every peer address setting.
const PeerAddrHelp = "accepts " + grpcclient.TargetForms

// CheckPeerAddr validates the peer address setting name, the one check every
// service applies to the addresses it dials (grpcclient.ParseTarget, which
// grpcclient.Dial applies too). An empty value is an error only when required.
func CheckPeerAddr(name, value string, required bool) error {
	if value == "" {
		if required {
			return ErrorFor(name, errors.New("required"))
		}
		return nil
	}
	if _, err := grpcclient.ParseTarget(value); err != nil {
		return ErrorFor(name, err)
	}
	return nil
}
