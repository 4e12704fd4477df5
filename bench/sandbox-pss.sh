#!/usr/bin/env bash
# agentplane's own memory in a live sandbox (issue 35 item 4): the PSS of
# every process of the sandbox's process tree, from /proc/<pid>/smaps_rollup,
# split into agentplane's share (bubblewrap — the outer boundary, its init and
# the runtime's nested bwrap — and the agentplane-wrapper) and the agent's
# (the runtime the wrapper starts and its children). Run as root on the node
# (a contained wrapper is not dumpable: only root reads its smaps).
#   bash bench/sandbox-pss.sh SANDBOX_ID
# One line per process (pid, share, PSS KiB with its anonymous and file-backed
# parts, command), then the totals in MiB.
set -euo pipefail
sbx=${1:?usage: sandbox-pss.sh SANDBOX_ID}

declare -A parent
for stat in /proc/[0-9]*/stat; do
	read -r line 2>/dev/null <"$stat" || continue
	pid=${line%% *}
	rest=${line##*) } # "pid (comm) state ppid ...": comm may hold spaces
	read -r _ ppid _ <<<"$rest"
	parent[$pid]=$ppid
done

# Roots: processes carrying the sandbox's marker whose parent does not.
declare -A marked
roots=0
for pid in "${!parent[@]}"; do
	if tr '\0' '\n' 2>/dev/null <"/proc/$pid/environ" | grep -qxF "AGENTPLANE_SANDBOX=$sbx"; then
		marked[$pid]=1
		roots=$((roots + 1))
	fi
done
((roots)) || { echo "no process of sandbox $sbx" >&2; exit 1; }

ours=0 agent=0
share_of() { # pid: agentplane or agent
	local exe args
	exe=$(readlink "/proc/$1/exe" 2>/dev/null || true)
	args=$(tr '\0' ' ' 2>/dev/null <"/proc/$1/cmdline" || true)
	case ${exe##*/} in
	bwrap) echo agentplane ;;
	agentplane-wrapper) [[ $args == *" wrapper "* ]] && echo agentplane || echo agent ;;
	*) echo agent ;;
	esac
}
walk() { # pid inherited-share
	local pid=$1 share=$2 kib child
	[[ $share == agent ]] || share=$(share_of "$pid")
	read -r kib anon file < <(awk '$1 == "Pss:" {p = $2} $1 == "Pss_Anon:" {a = $2} $1 == "Pss_File:" {f = $2}
		END {print p + 0, a + 0, f + 0}' "/proc/$pid/smaps_rollup" 2>/dev/null || echo 0 0 0)
	printf '%8s %-10s %8s KiB (anon %s, file %s)  %s\n' "$pid" "$share" "$kib" "$anon" "$file" \
		"$(tr '\0' ' ' 2>/dev/null <"/proc/$pid/cmdline" | cut -c1-60)"
	if [[ $share == agent ]]; then agent=$((agent + kib)); else ours=$((ours + kib)); fi
	for child in "${!parent[@]}"; do
		[[ ${parent[$child]} == "$pid" ]] && walk "$child" "$share"
	done
	return 0
}
for pid in "${!marked[@]}"; do
	[[ -n ${marked[${parent[$pid]}]:-} ]] || walk "$pid" ""
done
awk -v o="$ours" -v a="$agent" 'BEGIN { printf "agentplane %.1f MiB PSS, agent %.1f MiB PSS\n", o/1024, a/1024 }'
