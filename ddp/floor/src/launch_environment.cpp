// Which launcher started this process (the order and the variables are in launch_environment.h).
#include <ddp/launch_environment.h>

#include <cstdlib>
#include <stdexcept>

#include "ddp/internal/diagnostics/error_text.h"
#include "ddp/internal/numbers/parse_int.h"

namespace ddp {
namespace {

[[noreturn]] void fail_launch(const std::string& message) { raise<std::invalid_argument>("ddp", message); }

using Lookup = std::function<const char*(const char*)>;

// The value of `name`, or "" when unset or empty.
std::string get(const Lookup& lookup, const char* name) {
  const char* value = lookup(name);
  return value ? value : "";
}

int parse_launch_int(const std::string& text, const std::string& name, long lo, long hi) {
  return static_cast<int>(detail::parse_int(text, name, lo, hi, "ddp: "));
}

// A launcher is recognised by one of its variables; once recognised, each of `required` must be
// set: a partly set launcher is an error naming what is missing (it would otherwise hang).
void require_all(const Lookup& lookup, const std::vector<const char*>& required, const std::string& fix) {
  std::string missing, present;
  for (const char* name : required) {
    std::string& list = get(lookup, name).empty() ? missing : present;
    list += (list.empty() ? "" : ", ") + std::string(name);
  }
  if (missing.empty()) return;
  fail_launch(missing + " is not set, but " + present + " is: " + fix);
}

int rank_in_world(int rank, int world, const std::string& rank_name, const std::string& world_name) {
  if (rank >= world) {
    fail_launch(rank_name + "=" + std::to_string(rank) + " is out of range for " + world_name + "=" + std::to_string(world) +
         " (valid ranks: 0.." + std::to_string(world - 1) + ")");
  }
  return rank;
}

// Expands one item of a node list, which may hold several bracket groups (rack[1-2]-n[3-4]).
void expand_item(const std::string& item, const std::string& whole, std::vector<std::string>& out) {
  const auto open = item.find('[');
  if (open == std::string::npos) {
    if (item.find(']') != std::string::npos) fail_launch("node list '" + whole + "': ']' without '['");
    out.push_back(item);
    return;
  }
  const auto close = item.find(']', open);
  if (close == std::string::npos) fail_launch("node list '" + whole + "': '[' without ']'");
  const std::string prefix = item.substr(0, open);
  const std::string rest = item.substr(close + 1);
  const std::string ranges = item.substr(open + 1, close - open - 1);
  size_t start = 0;
  while (start <= ranges.size()) {
    const auto comma = std::min(ranges.find(',', start), ranges.size());
    const std::string range = ranges.substr(start, comma - start);
    const auto dash = range.find('-');
    const std::string first = range.substr(0, dash);
    const std::string last = dash == std::string::npos ? first : range.substr(dash + 1);
    const std::string what = "node list '" + whole + "' range '" + range + "'";
    if (first.empty() || last.empty() || first.find_first_not_of("0123456789") != std::string::npos ||
        last.find_first_not_of("0123456789") != std::string::npos) {
      fail_launch(what + ": expected numbers like 3-5 or 7");
    }
    const long lo = std::stol(first), hi = std::stol(last);
    if (hi < lo) fail_launch(what + " counts down");
    for (long n = lo; n <= hi; ++n) {
      std::string number = std::to_string(n);
      if (number.size() < first.size()) number.insert(0, first.size() - number.size(), '0');  // gpu[08-10]
      expand_item(prefix + number + rest, whole, out);
    }
    start = comma + 1;
  }
}

// The port every task of a Slurm job derives alike when MASTER_PORT is not set: in [15000, 35000),
// away from the usual 29500 and the ephemeral range, different for jobs sharing a node.
int slurm_port(const Lookup& lookup) {
  const std::string job = get(lookup, "SLURM_JOB_ID");
  if (job.empty()) fail_launch("under Slurm without SLURM_JOB_ID, set MASTER_PORT (a free port on the first node)");
  return 15000 + parse_launch_int(job, "SLURM_JOB_ID", 0, 2147483647L) % 20000;
}

}  // namespace

std::vector<std::string> expand_nodelist(const std::string& nodelist) {
  std::vector<std::string> hosts;
  int depth = 0;
  std::string item;
  for (char c : nodelist + ",") {
    if (c == '[') ++depth;
    if (c == ']' && --depth < 0) fail_launch("node list '" + nodelist + "': ']' without '['");
    if (c == ',' && depth == 0) {
      if (!item.empty()) expand_item(item, nodelist, hosts);
      item.clear();
    } else {
      item += c;
    }
  }
  if (depth != 0) fail_launch("node list '" + nodelist + "': '[' without ']'");
  if (hosts.empty()) fail_launch("node list '" + nodelist + "' names no host");
  return hosts;
}

LaunchEnvironment launch_environment(const Lookup& lookup) {
  LaunchEnvironment env;
  const std::string restarts = !get(lookup, "DDPRUN_RESTART_COUNT").empty() ? "DDPRUN_RESTART_COUNT"
                                                                              : "TORCHELASTIC_RESTART_COUNT";
  if (!get(lookup, restarts.c_str()).empty()) {
    env.restart_count = parse_launch_int(get(lookup, restarts.c_str()), restarts, 0, 1 << 20);
  }
  if (!get(lookup, "TORCHDDP_RUN_ID").empty()) {
    env.run_id = get(lookup, "TORCHDDP_RUN_ID");
  } else if (!get(lookup, "TORCHELASTIC_RUN_ID").empty()) {
    env.run_id = get(lookup, "TORCHELASTIC_RUN_ID");
  } else if (!get(lookup, "SLURM_JOB_ID").empty()) {
    env.run_id = "slurm-" + get(lookup, "SLURM_JOB_ID") + "." + get(lookup, "SLURM_STEP_ID");
  }
  auto master_from_variables = [&] {
    env.master_addr = get(lookup, "MASTER_ADDR");
    if (!get(lookup, "MASTER_PORT").empty()) env.master_port = parse_launch_int(get(lookup, "MASTER_PORT"), "MASTER_PORT", 1, 65535);
  };

  // 1. torchrun, ddprun, PyTorchJob.
  if (!get(lookup, "RANK").empty() || !get(lookup, "WORLD_SIZE").empty()) {
    require_all(lookup, {"RANK", "WORLD_SIZE"},
                "set both (ddprun and torchrun do), or pass InitOptions.rank and world_size");
    env.source = LaunchEnvironment::Source::kRankVariables;
    env.world_size = parse_launch_int(get(lookup, "WORLD_SIZE"), "WORLD_SIZE", 1, 1 << 20);
    env.rank = rank_in_world(parse_launch_int(get(lookup, "RANK"), "RANK", 0, 1 << 20), env.world_size, "RANK", "WORLD_SIZE");
    if (!get(lookup, "LOCAL_RANK").empty()) env.local_rank = parse_launch_int(get(lookup, "LOCAL_RANK"), "LOCAL_RANK", 0, 1 << 20);
    master_from_variables();
    // torchrun 2.x writes str(True); accept the spellings a person would write too.
    const std::string agent = get(lookup, "TORCHELASTIC_USE_AGENT_STORE");
    env.agent_store = agent == "True" || agent == "true" || agent == "1";
    return env;
  }

  // 2. Slurm (srun).
  if (!get(lookup, "SLURM_PROCID").empty()) {
    const char* nodelist_name = !get(lookup, "SLURM_JOB_NODELIST").empty() ? "SLURM_JOB_NODELIST" : "SLURM_NODELIST";
    require_all(lookup, {"SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID", nodelist_name},
                "start the ranks with srun (which sets all of them), or set the missing ones");
    env.source = LaunchEnvironment::Source::kSlurm;
    env.world_size = parse_launch_int(get(lookup, "SLURM_NTASKS"), "SLURM_NTASKS", 1, 1 << 20);
    env.rank = rank_in_world(parse_launch_int(get(lookup, "SLURM_PROCID"), "SLURM_PROCID", 0, 1 << 20), env.world_size,
                             "SLURM_PROCID", "SLURM_NTASKS");
    env.local_rank = parse_launch_int(get(lookup, "SLURM_LOCALID"), "SLURM_LOCALID", 0, 1 << 20);
    master_from_variables();
    if (env.master_addr.empty()) env.master_addr = expand_nodelist(get(lookup, nodelist_name)).front();
    if (env.master_port == 0) env.master_port = slurm_port(lookup);
    return env;
  }

  // 3. Open MPI (mpirun).
  if (!get(lookup, "OMPI_COMM_WORLD_RANK").empty() || !get(lookup, "OMPI_COMM_WORLD_SIZE").empty()) {
    require_all(lookup, {"OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE"},
                "start the ranks with mpirun (which sets both), or set the missing one");
    env.source = LaunchEnvironment::Source::kOpenMpi;
    env.world_size = parse_launch_int(get(lookup, "OMPI_COMM_WORLD_SIZE"), "OMPI_COMM_WORLD_SIZE", 1, 1 << 20);
    env.rank = rank_in_world(parse_launch_int(get(lookup, "OMPI_COMM_WORLD_RANK"), "OMPI_COMM_WORLD_RANK", 0, 1 << 20),
                             env.world_size, "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE");
    if (!get(lookup, "OMPI_COMM_WORLD_LOCAL_RANK").empty()) {
      env.local_rank = parse_launch_int(get(lookup, "OMPI_COMM_WORLD_LOCAL_RANK"), "OMPI_COMM_WORLD_LOCAL_RANK", 0, 1 << 20);
    }
    master_from_variables();  // MPI knows no master: env:// asks for MASTER_ADDR/MASTER_PORT
    return env;
  }

  // 4. No launcher: a world of one.
  return env;
}

LaunchEnvironment launch_environment() {
  return launch_environment([](const char* name) {
    const char* value = std::getenv(name);
    return value && *value ? value : nullptr;
  });
}

std::string LaunchEnvironment::describe() const {
  switch (source) {
    case Source::kRankVariables:
      return agent_store ? "RANK/WORLD_SIZE with torchrun's agent store" : "RANK/WORLD_SIZE";
    case Source::kSlurm: return "Slurm (SLURM_PROCID/SLURM_NTASKS/SLURM_JOB_NODELIST)";
    case Source::kOpenMpi: return "Open MPI (OMPI_COMM_WORLD_RANK/SIZE)";
    case Source::kNone: return "no launcher";
  }
  return "?";
}

int restart_count() { return launch_environment().restart_count; }

}  // namespace ddp
