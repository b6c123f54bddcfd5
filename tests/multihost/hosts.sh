#!/usr/bin/env bash
# Two "hosts" on this machine for multi-host tests: network namespaces mfsdp_h0 and mfsdp_h1 joined
# by a veth pair (10.77.0.1 <-> 10.77.0.2), each process started in one also gets its own UTS
# namespace and hostname (host0, host1), so that MPI and mfsdp see two nodes.
#   hosts.sh up | down | cut | mend       (cut/mend: the link down/up)
#   hosts.sh run H CMD...                  run CMD on host H (0 or 1); with MFSDP_HOST1_PRIVATE_DIR=D,
#                                          host 1 sees its own empty D (a tmpfs in a mount namespace)
# The launch agent for Open MPI (in place of ssh) is tests/multihost/netns_agent.sh.
set -euo pipefail
ns() { echo "mfsdp_h$1"; }
case "${1:?usage: hosts.sh up|down|cut|mend|run H CMD...}" in
  up)
    "$0" down 2>/dev/null || true
    for h in 0 1; do ip netns add "$(ns $h)"; ip -n "$(ns $h)" link set lo up; done
    ip link add mfsdp_v0 type veth peer name mfsdp_v1
    for h in 0 1; do
      ip link set "mfsdp_v$h" netns "$(ns $h)"
      ip -n "$(ns $h)" addr add "10.77.0.$((h + 1))/24" dev "mfsdp_v$h"
      ip -n "$(ns $h)" link set "mfsdp_v$h" up
    done
    ip -n "$(ns 0)" neigh flush all 2>/dev/null || true
    ;;
  down)
    for h in 0 1; do ip netns del "$(ns $h)" 2>/dev/null || true; done
    ;;
  cut) ip -n "$(ns 1)" link set mfsdp_v1 down ;;
  mend) ip -n "$(ns 1)" link set mfsdp_v1 up ;;
  run)
    h=${2:?host}
    shift 2
    if [ "$h" = 1 ] && [ -n "${MFSDP_HOST1_PRIVATE_DIR:-}" ]; then
      # host1 with a directory of its own (a local disk where the others have a shared one): a
      # mount namespace with a tmpfs over that path.
      exec ip netns exec "$(ns "$h")" unshare --uts --mount --propagation private sh -c \
        'hostname "$0"; mkdir -p "$MFSDP_HOST1_PRIVATE_DIR"; mount -t tmpfs tmpfs "$MFSDP_HOST1_PRIVATE_DIR"; exec "$@"' "host$h" "$@"
    fi
    exec ip netns exec "$(ns "$h")" unshare --uts sh -c 'hostname "$0"; exec "$@"' "host$h" "$@"
    ;;
  *) echo "hosts.sh: unknown command $1" >&2; exit 2 ;;
esac
