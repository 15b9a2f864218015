// Which launcher started a process: each launcher's variables as that launcher sets them, the
// order between them, Slurm's node lists, and a clear error for each half-set launcher.
#include <map>
#include <string>

#include <gtest/gtest.h>

#include <ddp/launch_environment.h>

namespace {

using Source = ddp::LaunchEnvironment::Source;
using Vars = std::map<std::string, std::string>;

ddp::LaunchEnvironment detect(const Vars& vars) {
  return ddp::launch_environment([&](const char* name) -> const char* {
    const auto found = vars.find(name);
    return found == vars.end() ? nullptr : found->second.c_str();
  });
}

std::string detect_error(const Vars& vars) {
  try {
    detect(vars);
  } catch (const std::invalid_argument& error) {
    return error.what();
  }
  return "no error";
}

// What torchrun 2.6 sets for worker 1 of 2 on a node (recorded from torchrun --standalone).
TEST(LaunchEnvironment, TorchrunVariables) {
  const auto env = detect({{"RANK", "1"}, {"WORLD_SIZE", "2"}, {"LOCAL_RANK", "1"}, {"MASTER_ADDR", "127.0.0.1"},
                           {"MASTER_PORT", "29500"}, {"TORCHELASTIC_USE_AGENT_STORE", "True"},
                           {"TORCHELASTIC_RESTART_COUNT", "2"}});
  EXPECT_EQ(env.source, Source::kRankVariables);
  EXPECT_EQ(env.rank, 1);
  EXPECT_EQ(env.world_size, 2);
  EXPECT_EQ(env.local_rank, 1);
  EXPECT_EQ(env.master_addr, "127.0.0.1");
  EXPECT_EQ(env.master_port, 29500);
  EXPECT_TRUE(env.agent_store);
  EXPECT_EQ(env.restart_count, 2);
}

// Kubeflow's PyTorchJob sets no LOCAL_RANK (one process per pod): 0. ddprun's restart count wins.
TEST(LaunchEnvironment, PyTorchJobAndDdprun) {
  const auto env = detect({{"RANK", "3"}, {"WORLD_SIZE", "4"}, {"MASTER_ADDR", "job-master-0"},
                           {"MASTER_PORT", "23456"}, {"DDPRUN_RESTART_COUNT", "1"}});
  EXPECT_EQ(env.local_rank, 0);
  EXPECT_FALSE(env.agent_store);
  EXPECT_EQ(env.restart_count, 1);
}

// The run id the rendezvous compares (two jobs on one port refuse each other): ddprun's, else
// torchrun's --rdzv-id, else the Slurm job step; none without a launcher that says.
TEST(LaunchEnvironment, RunIdFromEachLauncher) {
  const Vars rank_vars{{"RANK", "0"}, {"WORLD_SIZE", "1"}};
  auto with = [&](Vars extra) {
    extra.insert(rank_vars.begin(), rank_vars.end());
    return detect(extra).run_id;
  };
  EXPECT_EQ(with({{"TORCHDDP_RUN_ID", "0123abcd"}, {"TORCHELASTIC_RUN_ID", "none"}}), "0123abcd");
  EXPECT_EQ(with({{"TORCHELASTIC_RUN_ID", "job7"}}), "job7");
  EXPECT_EQ(detect({{"SLURM_PROCID", "0"}, {"SLURM_NTASKS", "1"}, {"SLURM_LOCALID", "0"}, {"SLURM_JOB_NODELIST", "n1"},
                    {"SLURM_JOB_ID", "42"}, {"SLURM_STEP_ID", "3"}})
                .run_id,
            "slurm-42.3");
  EXPECT_EQ(with({}), "");
}

// srun -n 4 over node[3-4] (2 tasks each): task 3 is the second task on node4.
TEST(LaunchEnvironment, SlurmTaskFindsTheFirstNodeAndAPortFromTheJob) {
  const auto env = detect({{"SLURM_PROCID", "3"}, {"SLURM_NTASKS", "4"}, {"SLURM_LOCALID", "1"},
                           {"SLURM_NODEID", "1"}, {"SLURM_JOB_NODELIST", "node[3-4]"}, {"SLURM_JOB_ID", "123456"}});
  EXPECT_EQ(env.source, Source::kSlurm);
  EXPECT_EQ(env.rank, 3);
  EXPECT_EQ(env.world_size, 4);
  EXPECT_EQ(env.local_rank, 1);
  EXPECT_EQ(env.master_addr, "node3");
  EXPECT_EQ(env.master_port, 15000 + 123456 % 20000);
  // MASTER_ADDR/MASTER_PORT, when exported, win over the derived ones.
  const auto given = detect({{"SLURM_PROCID", "0"}, {"SLURM_NTASKS", "2"}, {"SLURM_LOCALID", "0"},
                             {"SLURM_NODELIST", "a,b"}, {"MASTER_ADDR", "10.0.0.9"}, {"MASTER_PORT", "29400"}});
  EXPECT_EQ(given.master_addr, "10.0.0.9");
  EXPECT_EQ(given.master_port, 29400);
}

TEST(LaunchEnvironment, OpenMpiRankWithExportedMaster) {
  const auto env = detect({{"OMPI_COMM_WORLD_RANK", "1"}, {"OMPI_COMM_WORLD_SIZE", "2"},
                           {"OMPI_COMM_WORLD_LOCAL_RANK", "1"}, {"MASTER_ADDR", "127.0.0.1"}, {"MASTER_PORT", "29501"}});
  EXPECT_EQ(env.source, Source::kOpenMpi);
  EXPECT_EQ(env.rank, 1);
  EXPECT_EQ(env.local_rank, 1);
  EXPECT_EQ(env.master_port, 29501);
}

// torchrun inside a Slurm allocation: RANK/WORLD_SIZE (the launcher closest to the process) win.
TEST(LaunchEnvironment, RankVariablesWinOverSlurmAndSlurmOverOpenMpi) {
  EXPECT_EQ(detect({{"RANK", "0"}, {"WORLD_SIZE", "8"}, {"SLURM_PROCID", "1"}, {"SLURM_NTASKS", "2"}}).world_size, 8);
  EXPECT_EQ(detect({{"SLURM_PROCID", "1"}, {"SLURM_NTASKS", "2"}, {"SLURM_LOCALID", "0"}, {"SLURM_JOB_NODELIST", "n1"},
                    {"SLURM_JOB_ID", "7"}, {"OMPI_COMM_WORLD_RANK", "0"}, {"OMPI_COMM_WORLD_SIZE", "4"}})
                .source,
            Source::kSlurm);
}

TEST(LaunchEnvironment, NoLauncherIsAWorldOfOne) {
  const auto env = detect({{"PATH", "/usr/bin"}});
  EXPECT_EQ(env.source, Source::kNone);
  EXPECT_EQ(env.rank, 0);
  EXPECT_EQ(env.world_size, 1);
  EXPECT_EQ(env.local_rank, 0);
}

TEST(LaunchEnvironment, HalfSetLaunchersNameWhatIsMissing) {
  EXPECT_NE(detect_error({{"SLURM_PROCID", "0"}, {"SLURM_NTASKS", "2"}}).find(
                "SLURM_LOCALID, SLURM_NODELIST is not set, but SLURM_PROCID, SLURM_NTASKS is: start the ranks with srun"),
            std::string::npos)
      << detect_error({{"SLURM_PROCID", "0"}, {"SLURM_NTASKS", "2"}});
  EXPECT_NE(detect_error({{"OMPI_COMM_WORLD_RANK", "0"}}).find("OMPI_COMM_WORLD_SIZE is not set"), std::string::npos);
  EXPECT_NE(detect_error({{"RANK", "0"}}).find("WORLD_SIZE is not set, but RANK is"), std::string::npos);
  EXPECT_NE(detect_error({{"SLURM_PROCID", "x"}, {"SLURM_NTASKS", "2"}, {"SLURM_LOCALID", "0"}, {"SLURM_NODELIST", "a"},
                      {"SLURM_JOB_ID", "1"}})
                .find("SLURM_PROCID='x' is not an integer"),
            std::string::npos);
  EXPECT_NE(detect_error({{"SLURM_PROCID", "2"}, {"SLURM_NTASKS", "2"}, {"SLURM_LOCALID", "0"}, {"SLURM_NODELIST", "a"},
                      {"SLURM_JOB_ID", "1"}})
                .find("SLURM_PROCID=2 is out of range for SLURM_NTASKS=2"),
            std::string::npos);
  EXPECT_NE(detect_error({{"SLURM_PROCID", "0"}, {"SLURM_NTASKS", "2"}, {"SLURM_LOCALID", "0"}, {"SLURM_NODELIST", "a"}})
                .find("without SLURM_JOB_ID, set MASTER_PORT"),
            std::string::npos);
  EXPECT_NE(detect_error({{"SLURM_PROCID", "0"}, {"SLURM_NTASKS", "2"}, {"SLURM_LOCALID", "0"},
                      {"SLURM_JOB_NODELIST", "node[3-5"}, {"SLURM_JOB_ID", "1"}})
                .find("node list 'node[3-5': '[' without ']'"),
            std::string::npos);
}

TEST(ExpandNodelist, SlurmForms) {
  using List = std::vector<std::string>;
  EXPECT_EQ(ddp::expand_nodelist("node1"), List({"node1"}));
  EXPECT_EQ(ddp::expand_nodelist("node[3-5,9]"), List({"node3", "node4", "node5", "node9"}));
  EXPECT_EQ(ddp::expand_nodelist("gpu[08-10],login"), List({"gpu08", "gpu09", "gpu10", "login"}));
  EXPECT_EQ(ddp::expand_nodelist("rack[1-2]-n[7,9]"), List({"rack1-n7", "rack1-n9", "rack2-n7", "rack2-n9"}));
  EXPECT_EQ(ddp::expand_nodelist("a,b[1-2],c"), List({"a", "b1", "b2", "c"}));
  for (const char* bad : {"node[5-3]", "node]1[", "node[a-b]", "node[1-]", ""}) {
    EXPECT_THROW(ddp::expand_nodelist(bad), std::invalid_argument) << bad;
  }
}

}  // namespace
