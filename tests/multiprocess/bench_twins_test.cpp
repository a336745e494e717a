// W12's three programs in a configuration small enough for the CPU: the library's loop
// (bench/training.cpp through `accelerate launch`), the same loop in plain LibTorch
// (bench/training_plain.cpp) and the nanoGPT-style PyTorch twin (bench/training_twin.py, on
// Debian's PyTorch) train the same GPT on the same batch from the same seeds with AdamW: each
// must have trained, and all must end with the same loss.
#include "support/process.h"
#include "support/test_support.h"

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <regex>
#include <sstream>
#include <string>
#include <vector>

namespace accelerate::testing {
namespace {

// The "gpt2" record a program printed (a JSON object per line, "[rank0]: " before it through the launcher).
nlohmann::json gpt2_record(const std::string& out) {
  std::istringstream lines(out);
  for (std::string line; std::getline(lines, line);) {
    line = std::regex_replace(line, std::regex(R"(^\[rank\d+\]: )"), "");
    if (line.rfind("{", 0) != 0) continue;
    auto record = nlohmann::json::parse(line, nullptr, /*allow_exceptions=*/false);
    if (record.is_object() && record.value("workload", "") == "gpt2") return record;
  }
  return nullptr;
}

TEST(BenchTwins, TheThreeGpt2ProgramsTrainAndEndWithTheSameLoss) {
  const std::vector<std::string> tiny = {"--workloads", "gpt2", "--gpt_layers", "2", "--gpt_heads", "2",
                                         "--gpt_embd", "32", "--gpt_seq", "16", "--gpt_vocab", "64",
                                         "--gpt_batch", "2", "--gpt_warmup_steps", "1", "--gpt_steps", "6"};
  std::vector<std::string> library = {accelerate_bin(), "launch", "-n", "1", "--main_process_port", "0",
                                      "--num_cpu_threads_per_process", "1", built("bench/bench_training")};
  std::vector<std::string> plain = {built("bench/bench_training_plain"), "--threads", "1"};
  std::vector<std::string> twin = {"/usr/bin/python3", built("bench/training_twin.py"), "--nproc", "1", "--threads", "1"};
  std::vector<nlohmann::json> records;
  for (auto* argv : {&library, &plain, &twin}) {
    argv->insert(argv->end(), tiny.begin(), tiny.end());
    auto r = run(*argv, 240);
    ASSERT_EQ(r->exit_code(), 0) << (*argv)[0] << "\n" << r->out << r->err;
    records.push_back(gpt2_record(r->out));
    ASSERT_TRUE(records.back().is_object()) << "no gpt2 record from " << (*argv)[0] << ":\n" << r->out;
  }
  const char* sides[] = {"library", "plain LibTorch", "PyTorch twin"};
  for (size_t i = 0; i < records.size(); ++i) {
    const double first = records[i]["first_loss"].get<double>(), last = records[i]["last_loss"].get<double>();
    EXPECT_LT(last, first - 0.05) << sides[i] << " did not train: " << records[i].dump();
    EXPECT_GT(records[i].value("tokens_per_s", 0.0), 0) << sides[i] << ": " << records[i].dump();
    EXPECT_NEAR(first, records[0]["first_loss"].get<double>(), 1e-5) << sides[i] << " started elsewhere";
    EXPECT_NEAR(last, records[0]["last_loss"].get<double>(), 1e-4) << sides[i] << " ended elsewhere";
  }
}

}  // namespace
}  // namespace accelerate::testing
