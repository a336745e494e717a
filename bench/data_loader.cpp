// Data-loader throughput: batches per second of a prepared (sharded) DataLoader on each of 2+
// processes, over an in-memory dataset. Two workloads: "padded_tokens" (variable-length token
// sequences padded to the longest of the batch, an attention mask, per-batch normalised
// features: a non-trivial collate) and "mlp_features" (512 floats and a label per sample,
// default collate: the data of the training benchmark's MLP). Each with num_workers 0 and 2.
// Run through the launcher: `accelerate launch -n 2 bench_data_loader [--quick]`; rank 0 prints
// one JSON object per (workload, num_workers), as bench/data_loader_twin.py does for PyTorch.
#include <accelerate/accelerate.h>

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>

#include <chrono>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

namespace acc = accelerate;
using Clock = std::chrono::steady_clock;

namespace {

constexpr int64_t kSamples = 16384;
constexpr int64_t kBatchSize = 64;

struct Tokens {
  std::vector<at::Tensor> ids;       // int64 [length], length in [16, 128]
  std::vector<at::Tensor> features;  // float [64]
  at::Tensor labels;                 // int64 [kSamples]
};

Tokens make_tokens() {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(0);
  Tokens t;
  const auto lengths = at::randint(16, 129, {kSamples}, gen, at::kLong);
  const auto features = at::randn({kSamples, 64}, gen);
  t.labels = at::randint(0, 10, {kSamples}, gen, at::kLong);
  for (int64_t i = 0; i < kSamples; ++i) {
    t.ids.push_back(at::randint(1, 30000, {lengths[i].item<int64_t>()}, gen, at::kLong));
    t.features.push_back(features[i].clone());
  }
  return t;
}

// Pads the sequences to the longest of the batch, masks the padding, normalises the features.
acc::Example pad_collate(std::vector<acc::Example> samples) {
  const auto n = static_cast<int64_t>(samples.size());
  int64_t longest = 0;
  for (const auto& s : samples) longest = std::max(longest, s.data.size(0));
  auto ids = at::zeros({n, longest}, at::kLong);
  auto mask = at::zeros({n, longest}, at::kBool);
  std::vector<at::Tensor> features;
  std::vector<at::Tensor> labels;
  features.reserve(static_cast<size_t>(n));
  labels.reserve(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) {
    const auto& s = samples[static_cast<size_t>(i)];
    const int64_t length = s.data.size(0);
    ids[i].narrow(0, 0, length).copy_(s.data);
    mask[i].narrow(0, 0, length).fill_(true);
    features.push_back(s.fields.at("features").toTensor());
    labels.push_back(s.target);
  }
  auto f = at::stack(features);
  f = (f - f.mean(0)) / (f.std(0) + 1e-5);
  return acc::Example{ids, at::stack(labels), {{"attention_mask", mask}, {"features", f}}};
}

double batches_per_second(const acc::PartialState& state, const acc::GradientState& gs, const acc::DataLoader& loader,
                          int epochs) {
  auto prepared = acc::prepare_data_loader(loader, state, gs);
  int64_t sink = 0;
  for (auto& batch : prepared) sink += batch.data.size(0);  // warm-up epoch
  state.wait_for_everyone();
  const auto start = Clock::now();
  int64_t batches = 0;
  for (int e = 0; e < epochs; ++e) {
    for (auto& batch : prepared) {
      sink += batch.data.size(0);
      ++batches;
    }
  }
  const double seconds = std::chrono::duration<double>(Clock::now() - start).count();
  if (sink < 0) std::printf("impossible\n");
  return static_cast<double>(batches) / seconds;
}

void report(const acc::PartialState& state, const char* workload, int workers, double rate) {
  if (!state.is_main_process()) return;
  std::printf(
      "{\"side\": \"cpp\", \"workload\": \"%s\", \"num_workers\": %d, \"processes\": %d, "
      "\"batch_size\": %lld, \"batches_per_s\": %.2f}\n",
      workload, workers, state.num_processes(), static_cast<long long>(kBatchSize), rate);
  std::fflush(stdout);
}

}  // namespace

int main(int argc, char** argv) {
  const bool quick = argc > 1 && std::strcmp(argv[1], "--quick") == 0;
  const int epochs = quick ? 2 : 8;
  acc::PartialState state;
  acc::GradientState gradient_state;

  const auto tokens = std::make_shared<Tokens>(make_tokens());
  auto token_dataset = acc::make_dataset(kSamples, [tokens](int64_t i) {
    return acc::Example{tokens->ids[static_cast<size_t>(i)],
                        tokens->labels[i],
                        {{"features", tokens->features[static_cast<size_t>(i)]}}};
  });
  auto gen = at::make_generator<at::CPUGeneratorImpl>(1);
  auto mlp_dataset = std::make_shared<acc::TensorDataset>(at::randn({kSamples, 512}, gen),
                                                          at::randint(0, 10, {kSamples}, gen, at::kLong));

  for (int workers : {0, 2}) {
    acc::DataLoader tokens_loader(
        token_dataset, {.batch_size = kBatchSize, .shuffle = true, .num_workers = workers, .collate_fn = pad_collate});
    report(state, "padded_tokens", workers, batches_per_second(state, gradient_state, tokens_loader, epochs));
    acc::DataLoader mlp_loader(mlp_dataset, {.batch_size = kBatchSize, .shuffle = true, .num_workers = workers});
    report(state, "mlp_features", workers, batches_per_second(state, gradient_state, mlp_loader, epochs));
  }
  return 0;
}
