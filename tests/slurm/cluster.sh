#!/usr/bin/env bash
# Start or stop a real single-node Slurm cluster on localhost for the `slurm` tests:
# munged + slurmctld + slurmd from Debian's slurm-wlm, no slurmdbd (so no accounting;
# sacct is optional in lar). Everything lives under $LAR_SLURM_DIR (default
# /tmp/lar-slurm); the config is written to /etc/slurm/slurm.conf because the Slurm
# client commands (sbatch, squeue, scontrol) read it from there.
#   tests/slurm/cluster.sh start | stop | status
set -euo pipefail
DIR=${LAR_SLURM_DIR:-/tmp/lar-slurm}
CONF=/etc/slurm/slurm.conf
HOST=$(hostname -s)
CPUS=$(nproc)
MEM_MB=$(( $(awk '/MemTotal/ {print $2}' /proc/meminfo) / 1024 - 1024 ))

start() {
  mkdir -p "$DIR"/{state,spool,log,munge} /etc/slurm /run/munge
  # munge: a fresh key, its own socket and state under $DIR.
  if [ ! -f "$DIR/munge/munge.key" ]; then
    dd if=/dev/urandom bs=1 count=1024 of="$DIR/munge/munge.key" status=none
  fi
  chown -R munge:munge "$DIR/munge" /run/munge 2>/dev/null || true
  chmod 700 "$DIR/munge"; chmod 400 "$DIR/munge/munge.key"
  if ! pgrep -x munged >/dev/null; then
    runuser -u munge -- /usr/sbin/munged --key-file="$DIR/munge/munge.key" \
      --socket=/run/munge/munge.socket.2 --pid-file="$DIR/munge/munged.pid" \
      --log-file="$DIR/munge/munged.log" --seed-file="$DIR/munge/munged.seed" --force
  fi
  cat > "$CONF" <<CONF
# Written by lar's tests/slurm/cluster.sh — a single-node test cluster.
ClusterName=lartest
SlurmctldHost=$HOST
AuthType=auth/munge
CryptoType=crypto/munge
SlurmUser=root
SlurmdUser=root
StateSaveLocation=$DIR/state
SlurmdSpoolDir=$DIR/spool
SlurmctldPidFile=$DIR/slurmctld.pid
SlurmdPidFile=$DIR/slurmd.pid
SlurmctldLogFile=$DIR/log/slurmctld.log
SlurmdLogFile=$DIR/log/slurmd.log
SlurmctldPort=6817
SlurmdPort=6818
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SwitchType=switch/none
MpiDefault=none
ReturnToService=2
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobRequeue=1
MaxArraySize=1001
MinJobAge=300
KillWait=10
SlurmctldTimeout=30
SlurmdTimeout=30
InactiveLimit=0
NodeName=$HOST CPUs=$CPUS RealMemory=$MEM_MB State=UNKNOWN
PartitionName=debug Nodes=$HOST Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE:4
CONF
  echo "# no cgroups in the test cluster" > /etc/slurm/cgroup.conf
  pgrep -x slurmctld >/dev/null || /usr/sbin/slurmctld -c -f "$CONF"
  pgrep -x slurmd >/dev/null || /usr/sbin/slurmd -f "$CONF"
  for _ in $(seq 1 60); do
    if sinfo -h -o '%T' 2>/dev/null | grep -qE '^(idle|mixed|allocated)'; then
      echo "slurm: cluster up on $HOST ($CPUS CPUs)"; return 0
    fi
    scontrol update NodeName="$HOST" State=RESUME >/dev/null 2>&1 || true
    sleep 1
  done
  echo "slurm: the cluster did not come up; logs in $DIR/log" >&2
  tail -20 "$DIR/log/slurmctld.log" "$DIR/log/slurmd.log" >&2 || true
  return 1
}

stop() {
  scancel --user=root >/dev/null 2>&1 || true
  pkill -x slurmd 2>/dev/null || true
  pkill -x slurmctld 2>/dev/null || true
  sleep 1
  if [ -f "$DIR/munge/munged.pid" ]; then kill "$(cat "$DIR/munge/munged.pid")" 2>/dev/null || true; fi
  echo "slurm: cluster stopped"
}

case "${1:-}" in
  start) start ;;
  stop) stop ;;
  status) sinfo; squeue ;;
  *) echo "usage: $0 start|stop|status" >&2; exit 2 ;;
esac
