# A one-node Slurm cluster in a temporary folder, for main_job_test.sh (sourced): Debian's
# slurm-wlm and munge, no systemd. munged runs with a fresh key, slurmctld and slurmd as root on
# random ports, all files in $cluster. start_slurm exports SLURM_CONF (srun and sbatch find the
# cluster through it); stop_slurm stops the daemons (bounded, then SIGKILL) and removes the folder.
# Both expect a `fail` function (message, exit 1).

start_slurm() {
  cluster=$(mktemp -d)
  # The node is "localhost" at 127.0.0.1, whatever this machine is called: a CI machine's own
  # name need not resolve, and the ranks take their master from the job's node list.
  local host=localhost port
  head -c 1024 /dev/urandom >"$cluster/munge.key"
  chmod 400 "$cluster/munge.key"
  munged -f -S "$cluster/munge.socket" --key-file="$cluster/munge.key" --log-file="$cluster/munged.log" \
    --pid-file="$cluster/munged.pid" --seed-file="$cluster/munged.seed" || fail "munged did not start"
  port=$((30000 + RANDOM % 20000))
  mkdir -p "$cluster/state" "$cluster/spool"
  cat >"$cluster/slurm.conf" <<CONF
ClusterName=torchddp
SlurmctldHost=$host(127.0.0.1)
SlurmUser=root
SlurmdUser=root
SlurmctldPort=$port
SlurmdPort=$((port + 1))
AuthType=auth/munge
AuthInfo=socket=$cluster/munge.socket
CredType=cred/munge
StateSaveLocation=$cluster/state
SlurmdSpoolDir=$cluster/spool
SlurmctldPidFile=$cluster/slurmctld.pid
SlurmdPidFile=$cluster/slurmd.pid
SlurmctldLogFile=$cluster/slurmctld.log
SlurmdLogFile=$cluster/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SchedulerType=sched/builtin
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
MpiDefault=none
ReturnToService=2
NodeName=$host NodeAddr=127.0.0.1 CPUs=$(nproc) State=UNKNOWN
PartitionName=debug Nodes=$host Default=YES MaxTime=10 State=UP OverSubscribe=FORCE
CONF
  export SLURM_CONF=$cluster/slurm.conf
  slurmctld -f "$SLURM_CONF" || fail "slurmctld did not start: $(tail -n 5 "$cluster/slurmctld.log" 2>&1)"
  slurmd -f "$SLURM_CONF" -N "$host" || fail "slurmd did not start: $(tail -n 5 "$cluster/slurmd.log" 2>&1)"
  local _
  for _ in $(seq 60); do  # bounded: 30 s for the node to come up idle
    [[ $(sinfo -h -o %T 2>/dev/null) == idle ]] && return 0
    sleep 0.5
  done
  fail "the Slurm node never became idle: $(sinfo 2>&1; tail -n 5 "$cluster/slurmctld.log" "$cluster/slurmd.log" 2>&1)"
}

stop_slurm() {
  [[ -n ${cluster:-} && -d $cluster ]] || return 0
  local name pid alive _
  for name in slurmd slurmctld munged; do
    pid=$(cat "$cluster/$name.pid" 2>/dev/null) && kill "$pid" 2>/dev/null
  done
  for _ in $(seq 20); do  # bounded: 10 s to shut down, then SIGKILL
    alive=""
    for name in slurmd slurmctld munged; do
      pid=$(cat "$cluster/$name.pid" 2>/dev/null) && kill -0 "$pid" 2>/dev/null && alive=1
    done
    [[ -z $alive ]] && break
    sleep 0.5
  done
  for name in slurmd slurmctld munged; do
    pid=$(cat "$cluster/$name.pid" 2>/dev/null) && kill -9 "$pid" 2>/dev/null
  done
  rm -rf "$cluster"
}
