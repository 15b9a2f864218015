#pragma once
// Which launcher started this process, and what it says about the process's place in the job.
// init_process_group() (env://, the default), local_rank() and restart_count() read it, so one
// program starts unchanged under each of:
//
//   1. RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT   torchrun, ddprun, Kubeflow's
//      PyTorchJob (which sets no LOCAL_RANK: 0); with TORCHELASTIC_USE_AGENT_STORE=True (torchrun
//      2.x) the store is torchrun's own, and every rank connects to it as a client
//   2. SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID, SLURM_JOB_NODELIST   srun; the master is the first
//      host of the node list (node[3-5,9] -> node3), the port MASTER_PORT or one derived from
//      SLURM_JOB_ID, so every task of the step computes the same one
//   3. OMPI_COMM_WORLD_RANK, OMPI_COMM_WORLD_SIZE, OMPI_COMM_WORLD_LOCAL_RANK   mpirun (Open MPI);
//      MPI knows no master, so MASTER_ADDR and MASTER_PORT must be exported (mpirun -x)
//   4. none of these: a world of one (as hvd.init() without horovodrun), with a one-line notice
//
// The first source whose variables are set wins; a source whose variables are only partly set is
// an error naming the missing ones (a half-configured launcher would otherwise hang).
//
// Thread-safety: launch_environment() reads the process's environment; call it from any thread
// while no thread changes the environment.
#include <functional>
#include <string>
#include <vector>

namespace ddp {

struct LaunchEnvironment {
  enum class Source { kRankVariables, kSlurm, kOpenMpi, kNone };
  Source source = Source::kNone;
  int rank = 0;
  int world_size = 1;
  int local_rank = 0;
  std::string master_addr;  // "" when the launcher does not say (then env:// asks for MASTER_ADDR)
  int master_port = 0;      // 0 likewise
  bool agent_store = false; // the store at master_addr:master_port is hosted by the launcher
  int restart_count = 0;    // DDPRUN_RESTART_COUNT or TORCHELASTIC_RESTART_COUNT
  // Which job this rank belongs to, checked at the rendezvous so that ranks of two jobs sharing a
  // MASTER_PORT refuse each other: TORCHDDP_RUN_ID (ddprun), TORCHELASTIC_RUN_ID (torchrun's
  // --rdzv-id), "slurm-<SLURM_JOB_ID>.<SLURM_STEP_ID>" under srun; "" when none is known.
  std::string run_id;

  // "torchrun-style RANK/WORLD_SIZE", "Slurm (SLURM_PROCID, ...)", ...: for messages.
  std::string describe() const;
};

// Reads this process's environment. Throws std::invalid_argument naming the variable for a
// partly set launcher, a value that is not a number, or a node list that cannot be parsed.
LaunchEnvironment launch_environment();
// The same from any set of variables: `lookup` returns null for an unset one (tests, tools).
LaunchEnvironment launch_environment(const std::function<const char*(const char*)>& lookup);

// Slurm's compressed host lists: "node[3-5,9],login1" -> node3, node4, node5, node9, login1;
// zero padding is kept ("gpu[08-10]" -> gpu08, gpu09, gpu10). Throws std::invalid_argument for
// unbalanced brackets or a range that does not count up.
std::vector<std::string> expand_nodelist(const std::string& nodelist);

// How many times the launcher restarted the job so far (0 on the first attempt).
int restart_count();

}  // namespace ddp
