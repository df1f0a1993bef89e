#!/usr/bin/env bash
# A simulated multi-node network on one Linux machine, for benchmarks and tests (needs root).
#
# Each "node" is a network namespace with one interface, eth0, whose outgoing traffic is limited
# to RATE by a token-bucket filter (tc tbf) and, where the kernel has netem, delayed by DELAY.
# The nodes' eth0s are veth pairs whose other ends sit on a bridge in a "switch" namespace, so
# the host's own network is never touched. Addresses are SUBNET.1, SUBNET.2, ... (/24), private
# to these namespaces.
#
#   scripts/netns.sh up   [--prefix P] [--nodes N] [--rate 100mbit] [--delay 0.5ms] [--subnet 10.213.7]
#   scripts/netns.sh exec [--prefix P] NODE COMMAND...   # run COMMAND inside node NODE (0-based)
#   scripts/netns.sh addr [--prefix P] NODE              # print node NODE's address
#   scripts/netns.sh down [--prefix P]                   # stop what runs inside, delete everything
#   scripts/netns.sh check                               # exit 0 if namespaces can be made here
#
# Every byte between two nodes leaves one node's eth0, so limiting egress limits both directions.
set -euo pipefail

PREFIX=txn
NODES=2
RATE=1gbit
DELAY=
SUBNET=10.213.7

die() { echo "netns.sh: $*" >&2; exit 1; }

command_name=${1:-}
[ -n "$command_name" ] || die "usage: netns.sh up|down|exec|addr|check [options]"
shift
positional=()
while [ $# -gt 0 ]; do
  case "$1" in
    --prefix) PREFIX=$2; shift 2 ;;
    --nodes) NODES=$2; shift 2 ;;
    --rate) RATE=$2; shift 2 ;;
    --delay) DELAY=$2; shift 2 ;;
    --subnet) SUBNET=$2; shift 2 ;;
    *) positional=("$@"); break ;;
  esac
done
# Interface names are at most 15 characters: keep the prefix short.
[ ${#PREFIX} -le 8 ] || die "--prefix '$PREFIX' is longer than 8 characters; use a shorter one"

switch_ns="${PREFIX}-sw"
node_ns() { echo "${PREFIX}-n$1"; }

check() {
  command -v ip >/dev/null || { echo "iproute2 'ip' is not installed (apt-get install iproute2)"; return 1; }
  command -v tc >/dev/null || { echo "'tc' is not installed (apt-get install iproute2)"; return 1; }
  [ "$(id -u)" = 0 ] || { echo "network namespaces need root"; return 1; }
  local probe="${PREFIX}-probe$$"
  ip netns add "$probe" 2>/dev/null || { echo "'ip netns add' failed (no CAP_SYS_ADMIN or no netns support)"; return 1; }
  local ok=0
  ip -n "$probe" link add probe0 type veth peer name probe1 2>/dev/null || ok=1
  [ $ok = 0 ] && { ip netns exec "$probe" tc qdisc add dev probe0 root tbf rate 100mbit burst 32kb latency 50ms 2>/dev/null || ok=2; }
  ip netns del "$probe"
  [ $ok = 1 ] && { echo "veth pairs cannot be made here"; return 1; }
  [ $ok = 2 ] && { echo "tc tbf (sch_tbf) is not available in this kernel"; return 1; }
  return 0
}

down() {
  local ns pid
  for ns in $(ip netns list 2>/dev/null | awk '{print $1}' | grep -E "^${PREFIX}-(n[0-9]+|sw)$" || true); do
    # Stop what we started inside (only processes in our own namespaces).
    for pid in $(ip netns pids "$ns" 2>/dev/null); do kill -TERM "$pid" 2>/dev/null || true; done
  done
  sleep 0.2
  for ns in $(ip netns list 2>/dev/null | awk '{print $1}' | grep -E "^${PREFIX}-(n[0-9]+|sw)$" || true); do
    for pid in $(ip netns pids "$ns" 2>/dev/null); do kill -KILL "$pid" 2>/dev/null || true; done
    ip netns del "$ns" 2>/dev/null || true
  done
}

up() {
  local reason
  reason=$(check) || die "cannot build the network: $reason"
  down  # a leftover from an interrupted run would make every 'add' below fail
  trap 'down; exit 1' ERR INT TERM
  ip netns add "$switch_ns"
  ip -n "$switch_ns" link add br0 type bridge
  ip -n "$switch_ns" link set br0 up
  local i ns netem=1
  for ((i = 0; i < NODES; i++)); do
    ns=$(node_ns $i)
    ip netns add "$ns"
    ip -n "$ns" link set lo up
    # Made inside the node, then the far end is moved to the switch: nothing in the host namespace.
    ip -n "$ns" link add eth0 type veth peer name "${PREFIX}p$i"
    ip -n "$ns" link set "${PREFIX}p$i" netns "$switch_ns"
    ip -n "$switch_ns" link set "${PREFIX}p$i" master br0 up
    ip -n "$ns" addr add "${SUBNET}.$((i + 1))/24" dev eth0
    ip -n "$ns" link set eth0 up
    # The bandwidth limit. burst: enough for a 64 KB GSO segment; latency bounds the queue.
    ip netns exec "$ns" tc qdisc add dev eth0 root handle 1: tbf rate "$RATE" burst 256kb latency 200ms
    if [ -n "$DELAY" ]; then
      if ! ip netns exec "$ns" tc qdisc add dev eth0 parent 1:1 handle 10: netem delay "$DELAY" 2>/dev/null; then
        netem=0
      fi
    fi
  done
  [ $netem = 1 ] || echo "netns.sh: warning: netem is not available in this kernel; --delay $DELAY not applied" >&2
  trap - ERR INT TERM
  # The link must carry traffic before anyone relies on it.
  ip netns exec "$(node_ns 0)" ping -c 1 -W 2 "${SUBNET}.2" >/dev/null 2>&1 \
    || ip netns exec "$(node_ns 0)" bash -c "exec 3<>/dev/tcp/${SUBNET}.1/1" 2>/dev/null || true
  [ $netem = 1 ] || DELAY=
  echo "netns.sh: $NODES nodes ${SUBNET}.1-${SUBNET}.$NODES at $RATE${DELAY:+ (+$DELAY)}, prefix $PREFIX"
}

case "$command_name" in
  check) reason=$(check) && exit 0; echo "$reason"; exit 1 ;;
  up) up ;;
  down) down ;;
  addr) [ ${#positional[@]} -ge 1 ] || die "usage: netns.sh addr NODE"; echo "${SUBNET}.$((positional[0] + 1))" ;;
  exec)
    [ ${#positional[@]} -ge 2 ] || die "usage: netns.sh exec [--prefix P] NODE COMMAND..."
    node=${positional[0]}
    exec ip netns exec "$(node_ns "$node")" "${positional[@]:1}" ;;
  *) die "unknown command '$command_name'; use up, down, exec, addr or check" ;;
esac
