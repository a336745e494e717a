// Jobs under a real Slurm (tests/support/cluster.h): slurmctld and a slurmd on each of the two
// hosts of the test bed, jobs submitted from the first host with srun and sbatch.
// - `srun -N 2 --ntasks-per-node 2 prog` starts the processes itself; they must train like one
//   process and checkpoint across the nodes in the three folder modes;
// - an sbatch script with upstream's recipe runs `accelerate launch --rdzv_backend c10d` once per
//   node; it must train the same, end on scancel leaving nothing behind, and, preempted by the
//   signal Slurm sends before the time limit, save, requeue itself and resume to the result of a
//   run that was never interrupted.
#include "accelerate/utils/safetensors.h"
#include "support/cluster.h"
#include "support/hosts.h"
#include "support/process.h"
#include "support/test_support.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <ATen/ATen.h>

#include <filesystem>
#include <fstream>

namespace accelerate::testing {
namespace slurm_test {  // not anonymous: its names must not meet another file's in a unity batch

namespace fs = std::filesystem;
using ::testing::HasSubstr;
using ::testing::Not;
using Env = std::map<std::string, std::string>;

constexpr int kPreempted = 75;  // accelerate::kPreemptedExitCode

// Two hosts running Slurm, and a folder for the test; each slurmd's host has a folder of its own
// at `private_dir` (and so have the job steps it starts).
struct SlurmBed {
  HostPair hosts;
  TempDir dir;
  std::string private_dir = dir.str() + "/private";
  SlurmCluster slurm{hosts, dir.str(), private_dir};
};

#define ACCELERATE_REQUIRE_SLURM(bed)    \
  ACCELERATE_REQUIRE_HOSTS((bed).hosts); \
  ACCELERATE_REQUIRE_DAEMONS((bed).slurm)

// What every process of a job needs from the environment srun passes on.
Env job_env(Env more = {}) {
  more["ACCELERATE_RDZV_SECRET"] = "a-secret-both-hosts-know";
  more["ACCELERATE_RDZV_TIMEOUT"] = "60";
  more["OMP_NUM_THREADS"] = "1";
  more["MASTER_PORT"] = "29500";
  return more;
}

// `srun` of `program` as 2 tasks on each of the 2 nodes, waited for.
std::unique_ptr<Running> srun(const SlurmBed& bed, const std::vector<std::string>& program, const Env& env = {}) {
  std::vector<std::string> argv = {"srun", "--nodes=2", "--ntasks-per-node=2", "--kill-on-bad-exit=1"};
  argv.insert(argv.end(), program.begin(), program.end());
  return bed.slurm.command(argv, 240, job_env(env));
}

// The processes left on `host` besides Slurm's daemons, by name.
std::vector<std::string> job_processes(const HostPair& hosts, int host) {
  std::vector<std::string> left;
  for (pid_t pid : hosts.pids(host)) {
    std::ifstream in("/proc/" + std::to_string(pid) + "/comm");
    std::string name;
    if (!std::getline(in, name)) continue;  // gone meanwhile
    if (name != "slurmd" && name != "slurmctld" && name != "slurmscriptd") left.push_back(name + " (" + std::to_string(pid) + ")");
  }
  return left;
}

TEST(Slurm, SrunStartsTwoProcessesPerNodeAndTheyTrainLikeOneProcess) {
  SlurmBed bed;
  ACCELERATE_REQUIRE_SLURM(bed);
  auto r = srun(bed, {built("tests/mp_training"), "plain", "split_batches"});
  ASSERT_EQ(r->exit_code(), 0) << r->out << r->err << bed.slurm.logs();
  EXPECT_THAT(r->out, HasSubstr("plain: OK"));
  EXPECT_THAT(r->out, HasSubstr("split_batches: OK"));
  // Each node ran two of the ranks, with Slurm's numbering.
  auto placed = srun(bed, {worker_bin(), "state"});
  ASSERT_EQ(placed->exit_code(), 0) << placed->out << placed->err;
  for (int rank = 0; rank < 4; ++rank) {
    EXPECT_THAT(placed->out, HasSubstr("process " + std::to_string(rank) + " of 4 local " + std::to_string(rank % 2) +
                                       " type MULTI_CPU"));
  }
}

// Checkpoints across the nodes of an srun job: (shared folder?, save_on_each_node?). An unshared
// folder is under `private_dir`, which each node has its own of.
class SlurmCheckpoint : public ::testing::TestWithParam<std::pair<bool, bool>> {};

TEST_P(SlurmCheckpoint, ResumesBitForBitOnEveryRank) {
  const bool shared = GetParam().first;
  const bool each_node = GetParam().second;
  SlurmBed bed;
  ACCELERATE_REQUIRE_SLURM(bed);
  const std::string base = shared ? bed.dir.str() + "/shared" : bed.private_dir + "/project";
  Env env;
  if (each_node) env["MP_CHECKPOINT_SAVE_ON_EACH_NODE"] = "1";
  auto job = [&](const std::vector<std::string>& args) {
    std::vector<std::string> program = {built("tests/mp_checkpoint")};
    program.insert(program.end(), args.begin(), args.end());
    auto r = srun(bed, program, env);
    EXPECT_EQ(r->exit_code(), 0) << r->out << r->err;
    return r->exit_code() == 0;
  };
  ASSERT_TRUE(job({"full", base + "/a", bed.dir.str() + "/full"}));
  ASSERT_TRUE(job({"first", base + "/b"}));
  const std::string saved = "/b/checkpoints/checkpoint_0/model.safetensors";
  if (shared) {
    EXPECT_TRUE(fs::is_regular_file(base + saved));
  } else {  // each node's own copy
    for (int host = 0; host < 2; ++host) {
      const std::string own = bed.private_dir + "-" + bed.hosts.name(host) + "/project" + saved;
      EXPECT_TRUE(fs::is_regular_file(own)) << own;
    }
  }
  ASSERT_TRUE(job({"second", base + "/b", bed.dir.str() + "/resumed"}));
  expect_resumed_like_full(bed.dir.str(), 4);
}

INSTANTIATE_TEST_SUITE_P(Folders, SlurmCheckpoint,
                         ::testing::Values(std::pair{true, false}, std::pair{true, true}, std::pair{false, true}),
                         [](const auto& info) {
                           return std::string(info.param.first ? "Shared" : "Unshared") +
                                  (info.param.second ? "SaveOnEachNode" : "SaveOnMainProcess");
                         });

// A batch script with upstream's multi-node recipe: one `accelerate launch` per node, the first
// node's address for the rendezvous, machine ranks from the rendezvous. `before` and `after` are
// lines around the srun (the program's arguments may use shell variables).
std::string recipe(const std::string& program, const std::string& before = "", const std::string& after = "") {
  return "#!/bin/bash\n"
         "#SBATCH --nodes=2\n"
         "#SBATCH --ntasks-per-node=1\n"
         "PROCESSES_PER_NODE=2\n"
         "head_node_ip=$(scontrol show hostnames \"$SLURM_JOB_NODELIST\" | head -n 1)\n"
         "export ACCELERATE_RDZV_SECRET=$(head -c 16 /dev/urandom | od -An -tx1 | tr -d ' \\n')\n"
         "export LAUNCHER=\"" + accelerate_bin() + " launch \\\n"
         "    --num_processes $((SLURM_NNODES * PROCESSES_PER_NODE)) \\\n"
         "    --num_machines $SLURM_NNODES \\\n"
         "    --rdzv_backend c10d \\\n"
         "    --main_process_ip $head_node_ip \\\n"
         "    --main_process_port 29500 \\\n"
         "    --num_cpu_threads_per_process 1 \\\n"
         "    \"\n" +
         before + "srun $LAUNCHER " + program + "\n" + after;
}

// Submits `script` (written to the test's folder) with `flags`; returns the job's id.
std::string sbatch(const SlurmBed& bed, const std::string& name, const std::string& script,
                   const std::vector<std::string>& flags = {}) {
  const std::string path = bed.dir.str() + "/" + name + ".sh";
  std::ofstream(path) << script;
  std::vector<std::string> argv = {"sbatch", "--parsable", "--job-name=" + name,
                                   "--output=" + bed.dir.str() + "/" + name + "-%j.out"};
  argv.insert(argv.end(), flags.begin(), flags.end());
  argv.push_back(path);
  auto r = bed.slurm.command(argv, 30);
  EXPECT_EQ(r->exit_code(), 0) << r->err;
  std::string id = r->out.substr(0, r->out.find_first_of(";\n"));
  return id;
}

// Waits up to `seconds` for job `id` to leave the queue; its output file then.
std::string wait_for_job(const SlurmBed& bed, const std::string& name, const std::string& id, double seconds) {
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::duration<double>(seconds);
  while (!bed.slurm.job_state(id).empty()) {
    if (std::chrono::steady_clock::now() > deadline) {
      ADD_FAILURE() << "job " << id << " still in the queue after " << seconds << " s: "
                    << bed.slurm.job_state(id) << "\n" << bed.slurm.logs();
      break;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
  }
  std::ifstream in(bed.dir.str() + "/" + name + "-" + id + ".out");
  std::stringstream text;
  text << in.rdbuf();
  return text.str();
}

TEST(Slurm, AnSbatchScriptWithUpstreamsRecipeRunsOneLauncherPerNodeAndTrainsLikeOneProcess) {
  SlurmBed bed;
  ACCELERATE_REQUIRE_SLURM(bed);
  const std::string id = sbatch(bed, "recipe", recipe(built("tests/mp_training") + " plain"));
  const std::string out = wait_for_job(bed, "recipe", id, 180);
  EXPECT_THAT(out, HasSubstr("plain: OK"));
  // The second node's launcher took its machine rank at the rendezvous.
  EXPECT_THAT(out, HasSubstr("this is machine 1 of 2 (numbered at the rendezvous at " + bed.hosts.name(0) + ":29500)"));
  EXPECT_THAT(out, Not(HasSubstr("error")));
}

TEST(Slurm, ScancelEndsEveryProcessOnBothHostsAndTheLaunchersSayWhy) {
  SlurmBed bed;
  ACCELERATE_REQUIRE_SLURM(bed);
  const std::string pids = bed.dir.str() + "/pids";
  fs::create_directories(pids);
  const std::string id = sbatch(bed, "cancelled", recipe(worker_bin() + " barriers " + pids + " 60"));
  for (int rank = 0; rank < 4; ++rank) {
    ASSERT_GT(wait_for_int_file(pids + "/pid_" + std::to_string(rank), 120), 0) << bed.slurm.logs();
  }
  const auto cancelled = std::chrono::steady_clock::now();
  auto r = bed.slurm.command({"scancel", id}, 30);
  ASSERT_EQ(r->exit_code(), 0) << r->err;
  const std::string out = wait_for_job(bed, "cancelled", id, 60);
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - cancelled).count();
  EXPECT_LT(seconds, 30) << out;  // a hang would take the job's 60 s barriers, or Slurm's KillWait
  // Each node's launcher says it was stopped, and by what.
  EXPECT_THAT(out, HasSubstr("CANCELLED")) << out;
  std::istringstream lines(out);
  int stopped = 0;
  for (std::string line; std::getline(lines, line);) {
    if (line == "accelerate launch: stopped: the launcher received SIGTERM; its 2 worker(s) have ended") ++stopped;
  }
  EXPECT_EQ(stopped, 2) << out;
  for (int host = 0; host < 2; ++host) {
    const auto left = job_processes(bed.hosts, host);
    EXPECT_TRUE(left.empty()) << "host " << host << " still runs " << ::testing::PrintToString(left);
  }
  for (int rank = 0; rank < 4; ++rank) {
    const pid_t pid = wait_for_int_file(pids + "/pid_" + std::to_string(rank), 1);
    EXPECT_TRUE(process_gone(pid)) << "rank " << rank;
  }
}

// The final weights tests/mp_preemption wrote to `dir`.
std::map<std::string, at::Tensor> final_weights(const std::string& dir) {
  SafetensorsFile file(dir + "/final.safetensors");
  return {{"weight", file.get_tensor("weight")}, {"bias", file.get_tensor("bias")}};
}

void expect_equal(const std::map<std::string, at::Tensor>& got, const std::map<std::string, at::Tensor>& want) {
  for (const auto& [name, value] : want) EXPECT_TRUE(at::equal(got.at(name), value)) << name;
}

// tests/mp_preemption's steps of 4 processes, never interrupted, through srun.
std::map<std::string, at::Tensor> uninterrupted(const SlurmBed& bed, int steps) {
  const std::string ref = bed.dir.str() + "/reference";
  fs::create_directories(ref);
  auto r = srun(bed, {built("tests/mp_preemption"), "--dir", ref, "--steps", std::to_string(steps)});
  EXPECT_EQ(r->exit_code(), 0) << r->out << r->err;
  return final_weights(ref);
}

TEST(Slurm, ScancelWithASignalMakesEveryTaskSaveAndTheResumedRunEqualsAnUninterruptedOne) {
  SlurmBed bed;
  ACCELERATE_REQUIRE_SLURM(bed);
  const std::string run_dir = bed.dir.str() + "/run";
  fs::create_directories(run_dir);
  const std::vector<std::string> program = {built("tests/mp_preemption"), "--dir", run_dir, "--steps", "30"};
  auto with = [&](std::vector<std::string> more) {
    std::vector<std::string> argv = {"srun", "--nodes=2", "--ntasks-per-node=2", "--job-name=preempted"};
    argv.insert(argv.end(), program.begin(), program.end());
    argv.insert(argv.end(), more.begin(), more.end());
    return argv;
  };
  auto job = bed.slurm.start(with({"--mark", "3"}), job_env());
  for (int rank = 0; rank < 4; ++rank) {
    ASSERT_GT(wait_for_int_file(run_dir + "/mark_" + std::to_string(rank), 120), 0) << bed.slurm.logs();
  }
  auto r = bed.slurm.command({"scancel", "--signal=USR1", "--name=preempted"}, 30);
  ASSERT_EQ(r->exit_code(), 0) << r->err;
  job->wait(60);
  EXPECT_EQ(job->exit_code(), kPreempted) << job->out << job->err;
  EXPECT_THAT(job->err, HasSubstr("Exited with exit code 75"));
  ASSERT_TRUE(fs::is_regular_file(run_dir + "/checkpoints/checkpoint_0/model.safetensors"));
  auto resumed = bed.slurm.command(with({"--resume"}), 240, job_env());
  ASSERT_EQ(resumed->exit_code(), 0) << resumed->out << resumed->err;
  EXPECT_THAT(resumed->out, HasSubstr("finished at step 30"));
  expect_equal(final_weights(run_dir), uninterrupted(bed, 30));
}

TEST(Slurm, TheTimeLimitsSignalSavesTheJobWhichRequeuesItselfAndResumesToTheUninterruptedResult) {
  SlurmBed bed;
  ACCELERATE_REQUIRE_SLURM(bed);
  const std::string run_dir = bed.dir.str() + "/run";
  fs::create_directories(run_dir);
  // The first run slows down after step 1 (0.5 s a step), so that Slurm's signal, sent when 50 of
  // the limit's 60 s are left, finds it running; the requeued run resumes and is not slowed.
  const std::string script = recipe(
      built("tests/mp_preemption") + " --dir " + run_dir + " --steps 120 --resume_if_saved $mark",
      "mark=\"\"; [ \"${SLURM_RESTART_COUNT:-0}\" = 0 ] && mark=\"--mark 1\"\n",
      "status=$?\n"
      "echo \"run ${SLURM_RESTART_COUNT:-0} ended with status $status\"\n"
      "if [ $status -eq 75 ]; then scontrol requeue \"$SLURM_JOB_ID\"; fi\n"
      "exit $status\n");
  const std::string id = sbatch(bed, "limited", script, {"--time=1", "--signal=USR1@50", "--requeue", "--open-mode=append"});
  const std::string out = wait_for_job(bed, "limited", id, 240);
  EXPECT_THAT(out, HasSubstr("run 0 ended with status 75")) << out;
  EXPECT_THAT(out, HasSubstr("the job was preempted")) << out;
  EXPECT_THAT(out, HasSubstr("run 1 ended with status 0")) << out;
  EXPECT_THAT(out, HasSubstr("finished at step 120")) << out;
  expect_equal(final_weights(run_dir), uninterrupted(bed, 120));
}

TEST(Slurm, AnAllocationSmallerThanTheJobIsNamedInTheLaunchersLastLine) {
  SlurmBed bed;
  ACCELERATE_REQUIRE_SLURM(bed);
  // One node allocated, a job of two machines asked for.
  auto r = bed.slurm.command({"srun", "--nodes=1", "--ntasks=1", accelerate_bin(), "launch", "--num_processes", "4",
                              "--num_machines", "2", "--rdzv_backend", "c10d", "--main_process_ip", bed.hosts.name(0),
                              "--main_process_port", "29500", worker_bin(), "state"},
                             60, job_env());
  EXPECT_NE(r->exit_code(), 0);
  EXPECT_LT(r->elapsed, 30);
  EXPECT_THAT(r->err, HasSubstr("--num_machines 2, but its Slurm allocation (job " )) << r->err;
}

}  // namespace slurm_test
}  // namespace accelerate::testing
