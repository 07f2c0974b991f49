#!/usr/bin/env bash
# slurm_cluster.sh - a real, throwaway SLURM cluster on this machine, for the SLURM tests.
#
#   bash scripts/slurm_cluster.sh up      install slurm-wlm + munge if missing, start the daemons,
#                                         wait until every node is idle
#   bash scripts/slurm_cluster.sh down    stop the daemons this script started (by PID file)
#   bash scripts/slurm_cluster.sh env     print the line that points clients at the cluster
#
# Why a real cluster: the job files in recipes/slurm/ use sbatch, srun, signals and
# `scontrol requeue`; an emulation of SLURM's variables (tests/strategy/test_launchers.py)
# cannot show that a requeued job finds its checkpoint and resumes. Debian's slurm-wlm runs
# as root without systemd; two slurmd daemons on this host ("multiple slurmd") play two
# nodes, node1 and node2, so a 2-node job has real SLURM_NODEID/SLURM_PROCID placement.
#
# Environment (all optional):
#   SLURM_CI_ROOT   config, state, logs, PID files    (default /tmp/lightning-parallel-slurm)
#   SLURM_CI_NODES  emulated nodes node1..nodeN        (default 2)
#   SLURM_CI_CPUS   CPUs advertised per node           (default 8; may exceed the real cores, so
#                                                       that small CPU jobs run side by side)
#   SLURM_CI_PORT   slurmctld port; slurmd ports follow (default 6817)
#
# Clients (sbatch, srun, squeue, scontrol, scancel) need SLURM_CONF=$SLURM_CI_ROOT/etc/slurm.conf.
set -euo pipefail

ROOT=${SLURM_CI_ROOT:-/tmp/lightning-parallel-slurm}
NODES=${SLURM_CI_NODES:-2}
CPUS=${SLURM_CI_CPUS:-8}
PORT=${SLURM_CI_PORT:-6817}
HOSTS_MARK="# lightning_parallel scripts/slurm_cluster.sh"
export SLURM_CONF=$ROOT/etc/slurm.conf

node_names() { seq -f 'node%g' 1 "$NODES"; }

install_packages() {
  command -v slurmctld >/dev/null 2>&1 && command -v munged >/dev/null 2>&1 && return 0
  if [ "$(id -u)" != 0 ]; then
    echo "slurm_cluster.sh: slurm-wlm and munge are missing and only root can install them" \
         "(apt-get install slurm-wlm munge)" >&2
    return 1
  fi
  apt-get update -q
  DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends slurm-wlm munge
}

# Lightning derives MASTER_ADDR from SLURM_NODELIST (node1), so the node names must resolve.
add_hosts() {
  local missing=() n
  for n in $(node_names); do getent hosts "$n" >/dev/null || missing+=("$n"); done
  [ ${#missing[@]} = 0 ] && return 0
  echo "127.0.0.1 ${missing[*]} $HOSTS_MARK" >> /etc/hosts
}

remove_hosts() {
  grep -q "$HOSTS_MARK" /etc/hosts 2>/dev/null || return 0
  # Rewrite in place (not sed -i): /etc/hosts is often a bind mount that cannot be replaced.
  local kept; kept=$(grep -v "$HOSTS_MARK" /etc/hosts)
  printf '%s\n' "$kept" > /etc/hosts
}

write_config() {
  mkdir -p "$ROOT"/{etc,state,log,run,spool}
  local mem port n
  mem=$(awk '/MemTotal/ {print int($2 / 1024)}' /proc/meminfo)
  port=$((PORT + 2))
  {
    cat <<EOF
ClusterName=lightning-parallel
SlurmctldHost=localhost
SlurmctldPort=$PORT
SlurmdPort=$((PORT + 1))
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
# cred_expire also sets how long a requeued job waits before it may start again (default 120 s).
AuthInfo=cred_expire=10
MpiDefault=none
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerType=sched/backfill
SchedulerParameters=batch_sched_delay=0,sched_interval=2,bf_interval=1
SlurmdParameters=config_overrides
ReturnToService=2
MailProg=/bin/true
MinJobAge=300
KillWait=5
InactiveLimit=0
Waittime=0
StateSaveLocation=$ROOT/state
SlurmdSpoolDir=$ROOT/spool/%n
SlurmctldPidFile=$ROOT/run/slurmctld.pid
SlurmdPidFile=$ROOT/run/slurmd-%n.pid
SlurmctldLogFile=$ROOT/log/slurmctld.log
SlurmdLogFile=$ROOT/log/slurmd-%n.log
EOF
    for n in $(node_names); do
      echo "NodeName=$n NodeHostname=localhost NodeAddr=127.0.0.1 Port=$port CPUs=$CPUS RealMemory=$mem State=UNKNOWN"
      port=$((port + 1))
    done
    echo "PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP"
  } > "$SLURM_CONF"
}

start_munge() {
  [ -s /etc/munge/munge.key ] || runuser -u munge -- /usr/sbin/mungekey --create
  mkdir -p /run/munge && chown munge:munge /run/munge && chmod 0755 /run/munge
  if ! munge -n </dev/null 2>/dev/null | unmunge >/dev/null 2>&1; then
    runuser -u munge -- /usr/sbin/munged
    cp /run/munge/munged.pid "$ROOT/run/munged.pid"   # ours: `down` stops it
  fi
  munge -n </dev/null | unmunge >/dev/null
}

up() {
  install_packages
  down >/dev/null 2>&1 || true   # a cluster left by an interrupted run would hold the ports
  rm -rf "$ROOT/state"           # no jobs from an earlier cluster
  write_config
  add_hosts
  start_munge
  /usr/sbin/slurmctld -f "$SLURM_CONF"
  local n i
  for n in $(node_names); do
    mkdir -p "$ROOT/spool/$n"
    /usr/sbin/slurmd -f "$SLURM_CONF" -N "$n"
  done
  for i in $(seq 1 120); do
    if [ "$(sinfo -h -N -t idle -o %N 2>/dev/null | sort -u | wc -l)" = "$NODES" ]; then
      sinfo -N
      echo "export SLURM_CONF=$SLURM_CONF"
      return 0
    fi
    sleep 0.5
  done
  echo "slurm_cluster.sh: the nodes did not become idle within 60 s" >&2
  sinfo -N -l >&2 || true
  tail -n 30 "$ROOT"/log/*.log >&2 || true
  return 1
}

down() {
  local f pid pids=()
  for f in "$ROOT"/run/slurmd-*.pid "$ROOT"/run/slurmctld.pid "$ROOT"/run/munged.pid; do
    [ -s "$f" ] || continue
    pid=$(cat "$f")
    kill -TERM "$pid" 2>/dev/null && pids+=("$pid")
    rm -f "$f"
  done
  remove_hosts
  # Wait for them to exit; a zombie (state Z) counts as gone: PID 1 may reap late in containers.
  local i p s alive
  for i in $(seq 1 40); do
    alive=0
    for p in "${pids[@]}"; do
      s=$(ps -o stat= -p "$p" 2>/dev/null || true)
      [ -n "$s" ] && [ "${s#Z}" = "$s" ] && alive=1
    done
    [ $alive = 0 ] && return 0
    sleep 0.25
  done
  echo "slurm_cluster.sh: daemons still running after 10 s: ${pids[*]}" >&2
  return 1
}

case "${1:-}" in
  up) up ;;
  down) down ;;
  env) echo "export SLURM_CONF=$SLURM_CONF" ;;
  *) echo "usage: $0 up|down|env" >&2; exit 2 ;;
esac
