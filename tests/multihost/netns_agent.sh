#!/usr/bin/env bash
# Open MPI's launch agent (plm_rsh_agent) in place of ssh: `netns_agent.sh [ssh options] HOST CMD...`
# runs CMD (a shell command line, as ssh would) on the namespace host whose address HOST is.
set -euo pipefail
while [ $# -gt 0 ] && [ "${1#-}" != "$1" ]; do shift; done   # ssh-style options Open MPI may pass
host=${1:?host}
shift
case "$host" in
  10.77.0.1|host0) h=0 ;;
  10.77.0.2|host1) h=1 ;;
  *) echo "netns_agent: unknown host $host" >&2; exit 255 ;;
esac
exec "$(dirname "$0")/hosts.sh" run "$h" sh -c "$*"
