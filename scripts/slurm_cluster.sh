#!/usr/bin/env bash
# A real Slurm cluster on one Linux machine, for tests and benchmarks (needs root, Debian's
# slurm-wlm and munge, iproute2).
#
# The network is scripts/netns.sh's: namespace 0 is the controller and login node "ctl" (slurmctld;
# sbatch/srun/scontrol run there), namespaces 1..N are the compute nodes node1..nodeN (one slurmd
# each), every one with its own address on SUBNET and a link that can be cut. Each daemon also
# gets its own hostname (a UTS namespace) and an /etc/hosts naming every node (a bind mount in a
# mount namespace of its own), so node names resolve as on a real cluster and the machine's own
# /etc/hosts is never touched. munged runs in the host's namespaces: its socket is a file, which
# every network namespace can reach.
#
# slurmd is started with `nsenter --net=/run/netns/NAME`, not `ip netns exec`: the latter remounts
# /sys, which slurmd needs as the host's. Every file (config, keys, state, logs, spools) lives
# under DIR, so `down` followed by `rm -rf DIR` leaves nothing behind.
#
#   scripts/slurm_cluster.sh up   --dir DIR [--nodes 2] [--cpus 4] [--prefix P] [--subnet 10.214.9]
#   scripts/slurm_cluster.sh exec --dir DIR COMMAND...    # run COMMAND on the login node
#   scripts/slurm_cluster.sh node --dir DIR N COMMAND...  # run COMMAND on compute node N (1-based)
#   scripts/slurm_cluster.sh kill-node --dir DIR N        # node N dies: every process on it is killed
#   scripts/slurm_cluster.sh revive-node --dir DIR N      # node N boots again (a fresh slurmd)
#   scripts/slurm_cluster.sh down --dir DIR               # stop every daemon and job, remove the network
#   scripts/slurm_cluster.sh check                        # exit 0 if a cluster can be made here
#
# After `up`, DIR/env holds the variables a client needs (SLURM_CONF); `exec` sets them.
set -euo pipefail

HERE=$(cd "$(dirname "$0")" && pwd)
DIR=
NODES=2
CPUS=4
PREFIX=
SUBNET=10.214.9
# Shorter than Slurm's defaults so tests finish in seconds: a requeued job waits cred_expire (120 s
# by default) before it may start again; a cancelled step gets KillWait (30 s) between SIGTERM and
# SIGKILL; a node silent for SlurmdTimeout (300 s) is marked down.
CRED_EXPIRE=30
KILL_WAIT=8
SLURMD_TIMEOUT=20

die() { echo "slurm_cluster.sh: $*" >&2; exit 1; }

command_name=${1:-}
[ -n "$command_name" ] || die "usage: slurm_cluster.sh up|down|exec|node|check --dir DIR [options]"
shift
positional=()
while [ $# -gt 0 ]; do
  case "$1" in
    --dir) DIR=$2; shift 2 ;;
    --nodes) NODES=$2; shift 2 ;;
    --cpus) CPUS=$2; shift 2 ;;
    --prefix) PREFIX=$2; shift 2 ;;
    --subnet) SUBNET=$2; shift 2 ;;
    *) positional=("$@"); break ;;
  esac
done

check() {
  local program
  for program in slurmctld slurmd munged sbatch srun scontrol sinfo; do
    command -v "$program" >/dev/null || { echo "'$program' is not installed (apt-get install slurm-wlm munge)"; return 1; }
  done
  for program in nsenter unshare mount; do
    command -v "$program" >/dev/null || { echo "'$program' is not installed (apt-get install util-linux)"; return 1; }
  done
  bash "$HERE/netns.sh" check
}

need_dir() {
  [ -n "$DIR" ] || die "--dir DIR is required"
  DIR=$(cd "$DIR" 2>/dev/null && pwd) || die "--dir '$DIR' is not a directory"
  # The path is written into slurm.conf and into the daemons' command lines: plain characters only.
  [[ "$DIR" =~ ^[A-Za-z0-9._/+-]+$ ]] || die "--dir '$DIR' holds characters other than letters, digits and ._/+-; use a plainer path"
}

need_number() {  # NAME VALUE: a whole number from 1 to 99
  [[ "$2" =~ ^[1-9][0-9]?$ ]] || die "$1 '$2' is not a whole number from 1 to 99"
}

# The prefix is kept in DIR so that `down` and `exec` find the namespaces `up` made.
read_prefix() {
  [ -f "$DIR/prefix" ] || die "no cluster in $DIR (run 'up' first)"
  PREFIX=$(cat "$DIR/prefix")
  SUBNET=$(cat "$DIR/subnet")
}

# In a node's namespaces: its network, a hostname and /etc/hosts of its own. Then COMMAND.
in_node() {
  local namespace=$1 hostname=$2
  shift 2
  nsenter --net="/run/netns/$namespace" unshare --mount --uts --propagation private \
    sh -c 'mount --bind "$1" /etc/hosts && hostname "$2" && shift 2 && exec "$@"' \
    in_node "$DIR/hosts" "$hostname" "$@"
}

write_config() {
  local i
  {
    echo "127.0.0.1 localhost"
    echo "$SUBNET.1 ctl"
    for ((i = 1; i <= NODES; i++)); do echo "$SUBNET.$((i + 1)) node$i"; done
  } >"$DIR/hosts"
  cat >"$DIR/slurm.conf" <<EOF
ClusterName=triax
SlurmctldHost=ctl($SUBNET.1)
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket=$DIR/munge.socket,cred_expire=$CRED_EXPIRE
StateSaveLocation=$DIR/state
SlurmdSpoolDir=$DIR/spool/%n
SlurmctldPidFile=$DIR/run/slurmctld.pid
SlurmdPidFile=$DIR/run/slurmd.%n.pid
SlurmctldLogFile=$DIR/log/slurmctld.log
SlurmdLogFile=$DIR/log/slurmd.%n.log
PlugStackConfig=$DIR/plugstack.conf
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
SwitchType=switch/none
MpiDefault=none
SchedulerType=sched/builtin
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SlurmdParameters=config_overrides
ReturnToService=2
KillWait=$KILL_WAIT
SlurmdTimeout=$SLURMD_TIMEOUT
MessageTimeout=10
InactiveLimit=0
MinJobAge=600
JobRequeue=1
SlurmctldDebug=info
SlurmdDebug=info
EOF
  for ((i = 1; i <= NODES; i++)); do
    echo "NodeName=node$i NodeAddr=$SUBNET.$((i + 1)) CPUs=$CPUS RealMemory=1000 State=UNKNOWN" >>"$DIR/slurm.conf"
  done
  echo "PartitionName=debug Nodes=node[1-$NODES] Default=YES MaxTime=INFINITE State=UP" >>"$DIR/slurm.conf"
  : >"$DIR/plugstack.conf"
  {
    echo "export SLURM_CONF=$DIR/slurm.conf"
  } >"$DIR/env"
}

down() {
  need_dir
  [ -f "$DIR/prefix" ] || return 0
  read_prefix
  local pid_file pid
  # The daemons first (slurmd kills its jobs' steps when it stops), then whatever is left inside
  # the namespaces goes with them (netns.sh down), munged last.
  for pid_file in "$DIR"/run/slurmd.*.pid "$DIR"/run/slurmctld.pid; do
    [ -f "$pid_file" ] || continue
    pid=$(cat "$pid_file")
    kill -TERM "$pid" 2>/dev/null || true
  done
  bash "$HERE/netns.sh" down --prefix "$PREFIX" >/dev/null 2>&1 || true
  if [ -f "$DIR/run/munged.pid" ]; then
    # munged writes its seed file into DIR as it exits: wait for it (10 s at most), or the caller's
    # removal of DIR races that write and leaves DIR behind.
    pid=$(cat "$DIR/run/munged.pid")
    kill -TERM "$pid" 2>/dev/null || true
    for _ in $(seq 100); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
  fi
  rm -f "$DIR/prefix"
}

wait_for_nodes() {
  local deadline=$((SECONDS + 60)) state=
  while [ $SECONDS -lt $deadline ]; do
    state=$(in_node "$(controller_ns)" ctl env SLURM_CONF="$DIR/slurm.conf" sinfo -h -N -o "%N %t" 2>/dev/null || true)
    if [ "$(echo "$state" | grep -cE ' idle$' || true)" = "$NODES" ]; then return 0; fi
    sleep 0.5
  done
  die "the nodes did not become idle within 60 s (sinfo: ${state:-no answer}); see $DIR/log"
}

controller_ns() { echo "${PREFIX}-n0"; }

start_slurmd() {
  local i=$1
  setsid bash -c "$(declare -f in_node); DIR='$DIR'; in_node '${PREFIX}-n$i' node$i slurmd -D -N node$i -f '$DIR/slurm.conf'" \
    >>"$DIR/log/slurmd.node$i.out" 2>&1 </dev/null &
}

up() {
  need_dir
  local reason
  reason=$(check) || die "cannot make a cluster here: $reason"
  [ ! -f "$DIR/prefix" ] || die "a cluster is already up in $DIR; run 'down' first"
  PREFIX=${PREFIX:-sl$(head -c 3 /dev/urandom | od -An -tx1 | tr -d ' \n')}
  mkdir -p "$DIR/state" "$DIR/spool" "$DIR/run" "$DIR/log"
  chmod 700 "$DIR"
  echo "$PREFIX" >"$DIR/prefix"
  echo "$SUBNET" >"$DIR/subnet"
  # Whatever stops `up` half-way (a failed command, die, Ctrl-C) takes down what it started.
  trap 'down' EXIT
  trap 'exit 1' INT TERM
  write_config
  bash "$HERE/netns.sh" up --prefix "$PREFIX" --nodes $((NODES + 1)) --subnet "$SUBNET" --rate 10gbit >/dev/null

  # munge: a fresh key for this cluster only.
  head -c 1024 /dev/urandom >"$DIR/munge.key"
  chmod 400 "$DIR/munge.key"
  munged --force --socket="$DIR/munge.socket" --key-file="$DIR/munge.key" --pid-file="$DIR/run/munged.pid" \
    --log-file="$DIR/log/munged.log" --seed-file="$DIR/munged.seed" 2>>"$DIR/log/munged.log"

  export SLURM_CONF="$DIR/slurm.conf"
  # setsid: the daemons outlive this script and never get its terminal's signals.
  setsid bash -c "$(declare -f in_node); DIR='$DIR'; in_node '$(controller_ns)' ctl slurmctld -D -i -f '$DIR/slurm.conf'" \
    >>"$DIR/log/slurmctld.out" 2>&1 </dev/null &
  local i
  for ((i = 1; i <= NODES; i++)); do start_slurmd $i; done
  wait_for_nodes
  trap - EXIT INT TERM
  echo "slurm_cluster.sh: controller ctl ($SUBNET.1), nodes node[1-$NODES] ($SUBNET.2-$SUBNET.$((NODES + 1))), prefix $PREFIX, files in $DIR"
}

need_number --nodes "$NODES"
need_number --cpus "$CPUS"
[[ "$SUBNET" =~ ^[0-9]{1,3}\.[0-9]{1,3}\.[0-9]{1,3}$ ]] || die "--subnet '$SUBNET' is not three numbers such as 10.214.9"
[[ -z "$PREFIX" || "$PREFIX" =~ ^[a-z0-9]{1,8}$ ]] || die "--prefix '$PREFIX' is not 1-8 lowercase letters or digits"

case "$command_name" in
  check) reason=$(check) && exit 0; echo "$reason"; exit 1 ;;
  up) up ;;
  down) down ;;
  exec)
    need_dir; read_prefix
    [ ${#positional[@]} -ge 1 ] || die "usage: slurm_cluster.sh exec --dir DIR COMMAND..."
    export SLURM_CONF="$DIR/slurm.conf"
    in_node "$(controller_ns)" ctl "${positional[@]}" ;;
  node)
    need_dir; read_prefix
    [ ${#positional[@]} -ge 2 ] || die "usage: slurm_cluster.sh node --dir DIR N COMMAND..."
    need_number NODE "${positional[0]}"
    export SLURM_CONF="$DIR/slurm.conf"
    in_node "${PREFIX}-n${positional[0]}" "node${positional[0]}" "${positional[@]:1}" ;;
  kill-node)
    need_dir; read_prefix
    [ ${#positional[@]} -ge 1 ] || die "usage: slurm_cluster.sh kill-node --dir DIR N"
    need_number NODE "${positional[0]}"
    # The node dies: slurmd, its step daemons and the job's processes, all at once (SIGKILL).
    for pid in $(ip netns pids "${PREFIX}-n${positional[0]}" 2>/dev/null); do kill -KILL "$pid" 2>/dev/null || true; done ;;
  revive-node)
    need_dir; read_prefix
    [ ${#positional[@]} -ge 1 ] || die "usage: slurm_cluster.sh revive-node --dir DIR N"
    need_number NODE "${positional[0]}"
    # The node comes back: a fresh slurmd; the controller is told it may use the node again.
    export SLURM_CONF="$DIR/slurm.conf"
    start_slurmd "${positional[0]}"
    deadline=$((SECONDS + 30))
    until in_node "$(controller_ns)" ctl scontrol update NodeName="node${positional[0]}" State=RESUME 2>/dev/null \
        || in_node "$(controller_ns)" ctl sinfo -h -n "node${positional[0]}" -o %t | grep -qE 'idle|alloc|mix'; do
      [ $SECONDS -lt $deadline ] || die "node${positional[0]} did not come back within 30 s; see $DIR/log"
      sleep 0.5
    done ;;
  *) die "unknown command '$command_name'; use up, down, exec, node, kill-node, revive-node or check" ;;
esac
