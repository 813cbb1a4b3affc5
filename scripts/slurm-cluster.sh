#!/usr/bin/env bash
# A Slurm cluster in one directory, for the tests: munged, slurmctld and slurmd, each with its
# files and ports there.
#   cluster.sh start DIR CTLD_PORT SLURMD_PORT CPUS [NAME=NETNS=IP ...]
#       One node, this host; or one node per NAME=NETNS=IP, each slurmd in network namespace
#       NETNS with host name NAME (slurmctld in the first) and DIR/hosts as its /etc/hosts.
#       Two namespaces that do not exist yet are created, joined by a veth link with IP/24
#       each, and removed by `stop`. Waits until every node is idle.
#   cluster.sh stop DIR    cancels every job and stops the daemons.
# Commands then use the cluster with SLURM_CONF=DIR/slurm.conf (`cluster.sh run DIR CMD...` runs
# one on the first node of a cluster of namespaces). Needs root (slurmd starts jobs as their user) and Debian's slurmd,
# slurmctld, slurm-client and munge.
set -euo pipefail
cmd=$1 dir=$2

stop() {
  if [ -f "$dir/slurm.conf" ]; then
    SLURM_CONF="$dir/slurm.conf" scancel --full --quiet --user=root 2>/dev/null || true
  fi
  # Whatever still runs in a namespace this script created goes with it.
  if [ -f "$dir/created-netns" ]; then
    while read -r ns; do
      ip netns pids "$ns" 2>/dev/null | xargs -r kill -9
    done <"$dir/created-netns"
  fi
  for pidfile in "$dir"/*.pid; do
    [ -f "$pidfile" ] || continue
    pid=$(cat "$pidfile")
    kill "$pid" 2>/dev/null || true
    for _ in $(seq 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
    kill -9 "$pid" 2>/dev/null || true
  done
  if [ -f "$dir/created-netns" ]; then
    while read -r ns; do ip netns del "$ns" 2>/dev/null || true; done <"$dir/created-netns"
    rm -f "$dir/created-netns"
  fi
}

# Runs "$@" in node $1's namespace with its host name (or here, for a one-node cluster).
on_node() {
  local name=$1 ns=$2
  shift 2
  if [ -z "$ns" ]; then
    "$@"
  else
    # Not `ip netns exec`: it mounts a fresh /sys, without the cgroup hierarchy slurmd
    # insists on. The node's /etc/hosts is bound in a private mount namespace instead.
    nsenter --net="/run/netns/$ns" unshare --uts --mount --propagation private sh -c \
      'mount --bind "$0/hosts" /etc/hosts && hostname "$1" && shift && exec "$@"' \
      "$dir" "$name" "$@"
  fi
}

case "$cmd" in
start)
  # A daemon that fails to start leaves the ones before it running: stop them.
  trap 'stop' ERR
  ctld_port=$3 slurmd_port=$4 cpus=$5
  shift 5
  names=() namespaces=() addrs=()
  if [ $# -eq 0 ]; then
    names=("$(hostname -s)") namespaces=("") addrs=(127.0.0.1)
  fi
  for node in "$@"; do
    IFS== read -r name ns ip <<<"$node"
    names+=("$name") namespaces+=("$ns") addrs+=("$ip")
  done
  mkdir -p "$dir/state" "$dir/spool"
  chmod 700 "$dir"
  if [ "${#names[@]}" -eq 2 ] && [ -n "${namespaces[0]}" ] \
    && ! ip netns pids "${namespaces[0]}" >/dev/null 2>&1 \
    && ! ip netns pids "${namespaces[1]}" >/dev/null 2>&1; then
    a=${namespaces[0]} b=${namespaces[1]}
    printf '%s\n%s\n' "$a" "$b" >"$dir/created-netns"
    ip netns add "$a"
    ip netns add "$b"
    ip link add veth0 netns "$a" type veth peer name veth1 netns "$b"
    ip -n "$a" addr add "${addrs[0]}/24" dev veth0
    ip -n "$b" addr add "${addrs[1]}/24" dev veth1
    for ns in "$a" "$b"; do ip -n "$ns" link set lo up; done
    ip -n "$a" link set veth0 up
    ip -n "$b" link set veth1 up
  fi
  {
    echo "127.0.0.1 localhost"
    for i in "${!names[@]}"; do echo "${addrs[$i]} ${names[$i]}"; done
  } >"$dir/hosts"
  echo "${names[0]} ${namespaces[0]}" >"$dir/first-node"
  head -c 1024 /dev/urandom >"$dir/munge.key"
  chmod 400 "$dir/munge.key"
  munged --force --key-file="$dir/munge.key" --socket="$dir/munge.sock" \
    --pid-file="$dir/munged.pid" --log-file="$dir/munged.log" --seed-file="$dir/munge.seed"
  cat >"$dir/slurm.conf" <<CONF
ClusterName=accrs
SlurmctldHost=${names[0]}(${addrs[0]})
SlurmctldPort=$ctld_port
SlurmdPort=$slurmd_port
AuthType=auth/munge
AuthInfo=socket=$dir/munge.sock
CredType=cred/munge
SlurmUser=root
SlurmdUser=root
StateSaveLocation=$dir/state
SlurmdSpoolDir=$dir/spool/%n
SlurmctldPidFile=$dir/slurmctld.pid
SlurmdPidFile=$dir/slurmd-%n.pid
SlurmctldLogFile=$dir/slurmctld.log
SlurmdLogFile=$dir/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
MpiDefault=none
SwitchType=switch/none
SchedulerType=sched/builtin
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
ReturnToService=2
KillWait=5
InactiveLimit=0
JobCompType=jobcomp/none
AccountingStorageType=accounting_storage/none
SlurmdParameters=config_overrides
CONF
  for i in "${!names[@]}"; do
    echo "NodeName=${names[$i]} NodeAddr=${addrs[$i]} CPUs=$cpus State=UNKNOWN" >>"$dir/slurm.conf"
  done
  echo "PartitionName=test Nodes=ALL Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES" \
    >>"$dir/slurm.conf"
  export SLURM_CONF="$dir/slurm.conf"
  on_node "${names[0]}" "${namespaces[0]}" slurmctld -i
  for i in "${!names[@]}"; do
    on_node "${names[$i]}" "${namespaces[$i]}" slurmd -N "${names[$i]}"
  done
  for _ in $(seq 150); do
    states=$(on_node "${names[0]}" "${namespaces[0]}" sinfo -h -N -o %T 2>/dev/null | sort -u)
    if [ "$states" = idle ]; then exit 0; fi
    sleep 0.2
  done
  echo "the Slurm node did not come up; logs in $dir:" >&2
  tail -n 20 "$dir"/*.log >&2 || true
  stop
  exit 1
  ;;
stop)
  stop
  ;;
run)
  shift 2
  read -r name ns <"$dir/first-node"
  SLURM_CONF="$dir/slurm.conf" on_node "$name" "$ns" "$@"
  ;;
*)
  echo "usage: cluster.sh start DIR CTLD_PORT SLURMD_PORT CPUS [NAME=NETNS=IP...] | stop DIR |" \
    "run DIR COMMAND..." >&2
  exit 2
  ;;
esac
