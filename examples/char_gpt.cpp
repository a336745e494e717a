// The main example: a character-level GPT trained on Shakespeare with everything a real run has.
//
//   accelerate launch --num_processes 2 build/release/examples/char_gpt
//
// What it shows (upstream's examples/nlp_example.py and complete_nlp_example.py, for a GPT):
//   - one loop for 1 or N processes: `prepare` shards the data and synchronises the gradients;
//   - mixed precision (`--mixed_precision bf16`, or `accelerate launch --mixed_precision bf16`);
//   - gradient accumulation (`--gradient_accumulation_steps`) with `accumulate`;
//   - a cosine learning-rate schedule with warmup;
//   - periodic evaluation on held-out text, gathered from every process with `gather_for_metrics`;
//   - TensorBoard and JSONL logging (`<output_dir>/logs/char_gpt`) through `log_with`
//     (`--log_with` adds W&B offline runs, an MLflow server, CSV, dvclive);
//   - a progress bar and log lines on the main process only;
//   - crash-safe checkpoints every `--checkpoint_every` steps, and `--resume` from the newest;
//   - asked to stop (SIGTERM, SIGUSR1), it saves at the next step and ends with status 75;
//   - tensor parallelism (`--tp_size 2`): each block's attention heads and MLP split over 2
//     processes, Megatron-LM's way, data parallelism over the rest; with `--sequence_parallel`
//     the blocks' norms also run on pieces of the sequence;
//   - context parallelism (`--cp_size 2`): each sequence split over 2 processes inside
//     `maybe_context_parallel`, attention computed as ring attention over them;
//   - a text sample from the trained model at the end.
// The defaults take about 2.5 minutes on two CPU cores; the validation loss falls from ~4.4 (about
// a uniform guess over the 65 characters) to ~1.6.
#include <accelerate/accelerate.h>

#include <torch/torch.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <map>
#include <set>
#include <sstream>
#include <string>

namespace acc = accelerate;

namespace {

// ---- settings ---------------------------------------------------------------------------------

struct Settings {
  std::string data;  // default: data/tinyshakespeare.txt beside the program, else under examples/
  std::string output_dir = "runs/char_gpt";
  std::string mixed_precision;  // empty: the launcher's choice
                                // (ACCELERATE_MIXED_PRECISION), else "no"
  int64_t max_steps = 800;
  int64_t batch_size = 16;  // per process
  int gradient_accumulation_steps = 2;
  int64_t block_size = 64;
  int64_t n_layer = 4;
  int64_t n_head = 4;
  int64_t n_embd = 128;
  double learning_rate = 3e-3;
  int64_t warmup_steps = 80;
  int64_t eval_every = 200;
  int64_t eval_samples = 256;
  int64_t checkpoint_every = 200;
  int total_limit = 2;
  bool resume = false;
  int64_t sample_length = 300;
  uint64_t seed = 1337;
  int tp_size = 1;  // processes each block's heads and MLP are split over
  bool sequence_parallel = false;  // with tp_size: the blocks' norms run on pieces of the sequence
  int cp_size = 1;  // processes each sequence is split over (ring attention)
  // Trackers, comma separated: also "csv", "dvclive", "wandb" (an offline run for `wandb sync`)
  // and "mlflow" (a tracking server at MLFLOW_TRACKING_URI).
  std::string log_with = "tensorboard,jsonl";
};

[[noreturn]] void usage_error(const std::string& message) {
  std::cerr << "char_gpt: " << message << "\n"
            << "usage: char_gpt [--data FILE] [--output_dir DIR] [--mixed_precision "
               "no|bf16|fp16] [--max_steps N]\n"
               "                [--batch_size N] [--gradient_accumulation_steps N] "
               "[--block_size N] [--n_layer N]\n"
               "                [--n_head N] [--n_embd N] [--learning_rate X] "
               "[--warmup_steps N] [--eval_every N]\n"
               "                [--eval_samples N] [--checkpoint_every N] "
               "[--total_limit N] [--sample_length N]\n"
               "                [--seed N] [--tp_size N] [--sequence_parallel] [--cp_size N]\n"
               "                [--log_with tensorboard,jsonl,csv,dvclive,wandb,mlflow] [--resume]\n";
  std::exit(2);
}

Settings parse_settings(int argc, char** argv) {
  Settings s;
  std::map<std::string, std::function<void(const std::string&)>> flags = {
      {"--data", [&](const std::string& v) { s.data = v; }},
      {"--output_dir", [&](const std::string& v) { s.output_dir = v; }},
      {"--mixed_precision", [&](const std::string& v) { s.mixed_precision = v; }},
      {"--max_steps", [&](const std::string& v) { s.max_steps = std::stoll(v); }},
      {"--batch_size", [&](const std::string& v) { s.batch_size = std::stoll(v); }},
      {"--gradient_accumulation_steps", [&](const std::string& v) { s.gradient_accumulation_steps = std::stoi(v); }},
      {"--block_size", [&](const std::string& v) { s.block_size = std::stoll(v); }},
      {"--n_layer", [&](const std::string& v) { s.n_layer = std::stoll(v); }},
      {"--n_head", [&](const std::string& v) { s.n_head = std::stoll(v); }},
      {"--n_embd", [&](const std::string& v) { s.n_embd = std::stoll(v); }},
      {"--learning_rate", [&](const std::string& v) { s.learning_rate = std::stod(v); }},
      {"--warmup_steps", [&](const std::string& v) { s.warmup_steps = std::stoll(v); }},
      {"--eval_every", [&](const std::string& v) { s.eval_every = std::stoll(v); }},
      {"--eval_samples", [&](const std::string& v) { s.eval_samples = std::stoll(v); }},
      {"--checkpoint_every", [&](const std::string& v) { s.checkpoint_every = std::stoll(v); }},
      {"--total_limit", [&](const std::string& v) { s.total_limit = std::stoi(v); }},
      {"--sample_length", [&](const std::string& v) { s.sample_length = std::stoll(v); }},
      {"--seed", [&](const std::string& v) { s.seed = std::stoull(v); }},
      {"--tp_size", [&](const std::string& v) { s.tp_size = std::stoi(v); }},
      {"--cp_size", [&](const std::string& v) { s.cp_size = std::stoi(v); }},
      {"--log_with", [&](const std::string& v) { s.log_with = v; }},
  };
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    if (arg == "--resume") {
      s.resume = true;
      continue;
    }
    if (arg == "--sequence_parallel") {
      s.sequence_parallel = true;
      continue;
    }
    if (arg == "-h" || arg == "--help") usage_error("trains a character-level GPT");
    auto it = flags.find(arg);
    if (it == flags.end()) usage_error("unknown argument '" + arg + "'");
    if (i + 1 >= argc) usage_error(arg + " needs a value");
    try {
      it->second(argv[++i]);
    } catch (const std::exception&) {
      usage_error(arg + " expects a number, got '" + std::string(argv[i]) + "'");
    }
  }
  if (s.max_steps < 1 || s.batch_size < 1 || s.gradient_accumulation_steps < 1 || s.block_size < 1 ||
      s.eval_every < 1 || s.checkpoint_every < 1 || s.eval_samples < 1) {
    usage_error("step counts, sizes and intervals must be positive");
  }
  if (s.n_embd % s.n_head != 0) usage_error("--n_embd must be a multiple of --n_head");
  if (s.tp_size < 1 || s.n_head % s.tp_size != 0) usage_error("--tp_size must divide --n_head");
  if (s.cp_size < 1 || s.block_size < 2 * s.cp_size) usage_error("--cp_size needs --block_size of at least 2 per process");
  if (s.data.empty()) {
    // The build copies the text beside the program; from a source checkout it is under examples/.
    const auto beside = std::filesystem::read_symlink("/proc/self/exe").parent_path() / "data/tinyshakespeare.txt";
    s.data = std::filesystem::exists(beside) ? beside.string() : "examples/data/tinyshakespeare.txt";
  }
  return s;
}

// ---- data -------------------------------------------------------------------------------------

// The text as character ids, and the alphabet to turn ids back into text.
struct Corpus {
  std::string alphabet;
  torch::Tensor ids;  // int64, one per character
};

Corpus read_corpus(const std::string& path) {
  std::ifstream file(path, std::ios::binary);
  TORCH_CHECK(file.good(), "cannot read the training text '", path, "' (pass --data)");
  std::stringstream buffer;
  buffer << file.rdbuf();
  const std::string text = buffer.str();
  TORCH_CHECK(text.size() > 1000, "the training text '", path, "' is too short");
  std::set<char> chars(text.begin(), text.end());
  Corpus corpus{std::string(chars.begin(), chars.end()),
                torch::empty({static_cast<int64_t>(text.size())}, torch::kLong)};
  int64_t index_of[256] = {};
  for (size_t i = 0; i < corpus.alphabet.size(); ++i) index_of[static_cast<unsigned char>(corpus.alphabet[i])] = i;
  auto* out = corpus.ids.data_ptr<int64_t>();
  for (size_t i = 0; i < text.size(); ++i) out[i] = index_of[static_cast<unsigned char>(text[i])];
  return corpus;
}

// Non-overlapping windows of `block` characters; the target is the window shifted by one.
std::shared_ptr<acc::TensorDataset> windows(const torch::Tensor& ids, int64_t block, int64_t limit = -1) {
  int64_t count = (ids.size(0) - 1) / block;
  if (limit > 0) count = std::min(count, limit);
  auto x = ids.slice(0, 0, count * block).view({count, block});
  auto y = ids.slice(0, 1, count * block + 1).view({count, block});
  return std::make_shared<acc::TensorDataset>(x, y);
}

// ---- the model --------------------------------------------------------------------------------

// The layers are accelerate::nn holders, which run their hooks on `qkv(x)`: with --tp_size, qkv and
// fc are split by columns (each process computes its heads, its part of the MLP), proj and fc_out
// by rows (their partial outputs summed), as Megatron-LM splits a block.
struct BlockImpl : torch::nn::Module {
  BlockImpl(int64_t n_embd, int64_t n_head) : n_head(n_head) {
    ln1 = register_module("ln1", acc::nn::LayerNorm(torch::nn::LayerNormOptions({n_embd})));
    qkv = register_module("qkv", acc::nn::Linear(n_embd, 3 * n_embd));
    proj = register_module("proj", acc::nn::Linear(n_embd, n_embd));
    ln2 = register_module("ln2", acc::nn::LayerNorm(torch::nn::LayerNormOptions({n_embd})));
    fc = register_module("fc", acc::nn::Linear(n_embd, 4 * n_embd));
    fc_out = register_module("fc_out", acc::nn::Linear(4 * n_embd, n_embd));
  }

  torch::Tensor forward(torch::Tensor x) {
    const int64_t B = x.size(0), T = x.size(1), C = x.size(2), hs = C / n_head;
    // qkv's outputs are laid out head by head (q, k, v of head 0, then of head 1, ...), so a split
    // by columns gives each process whole heads; `heads` is how many this process computes.
    auto qkv_out = qkv(ln1(x));
    const int64_t heads = qkv_out.size(2) / (3 * hs);
    auto parts = qkv_out.view({B, T, heads, 3, hs}).permute({3, 0, 2, 1, 4});  // [3, B, heads, T, hs]
    // Causal attention through LibTorch's fused kernels (flash attention on a GPU) where the
    // release has them, written out where it does not.
    auto y = acc::scaled_dot_product_attention(parts[0], parts[1], parts[2], std::nullopt, 0.0, /*is_causal=*/true)
                 .transpose(1, 2)
                 .contiguous()
                 .view({B, T, heads * hs});
    x = x + proj(y);
    return x + fc_out(torch::gelu(fc(ln2(x))));
  }

  int64_t n_head;
  acc::nn::LayerNorm ln1{nullptr}, ln2{nullptr};
  acc::nn::Linear qkv{nullptr}, proj{nullptr}, fc{nullptr}, fc_out{nullptr};
};
TORCH_MODULE(Block);

struct GPTImpl : torch::nn::Module, acc::nn::TensorParallelPlanned {
  GPTImpl(int64_t vocab, const Settings& s) : block_size(s.block_size), sequence_parallel(s.sequence_parallel) {
    tok = register_module("tok", torch::nn::Embedding(vocab, s.n_embd));
    pos = register_module("pos", torch::nn::Embedding(s.block_size, s.n_embd));
    blocks = register_module("blocks", torch::nn::ModuleList());
    for (int64_t i = 0; i < s.n_layer; ++i) blocks->push_back(Block(s.n_embd, s.n_head));
    ln_f = register_module("ln_f", torch::nn::LayerNorm(torch::nn::LayerNormOptions({s.n_embd})));
    head = register_module("head", torch::nn::Linear(s.n_embd, vocab));
  }

  // The split of each block under tensor parallelism (the embeddings and head stay whole: the
  // 65-character vocabulary does not divide). With --sequence_parallel each block's norms run on
  // this process's piece of the sequence, their outputs gathered whole.
  std::vector<std::pair<std::string, std::string>> tp_plan() const override {
    std::vector<std::pair<std::string, std::string>> plan = {
        {"blocks.*.qkv", "colwise"}, {"blocks.*.proj", "rowwise"}, {"blocks.*.fc", "colwise"},
        {"blocks.*.fc_out", "rowwise"}};
    if (sequence_parallel) plan.insert(plan.end(), {{"blocks.*.ln1", "sequence_parallel"}, {"blocks.*.ln2", "sequence_parallel"}});
    return plan;
  }

  // Logits [batch, time, vocab] for ids [batch, time] at `positions` (by default 0, 1, ...; under
  // context parallelism this process's piece of the sequence holds other positions).
  torch::Tensor forward(const torch::Tensor& ids, const torch::Tensor& positions = {}) {
    auto x = tok(ids) + pos(positions.defined() ? positions : torch::arange(ids.size(1), ids.options()));
    for (const auto& block : *blocks) x = block->as<Block>()->forward(x);
    return head(ln_f(x));
  }

  int64_t block_size;
  bool sequence_parallel;
  torch::nn::Embedding tok{nullptr}, pos{nullptr};
  torch::nn::ModuleList blocks{nullptr};
  torch::nn::LayerNorm ln_f{nullptr};
  torch::nn::Linear head{nullptr};
};
TORCH_MODULE(GPT);

torch::Tensor loss_per_sample(const torch::Tensor& logits, const torch::Tensor& targets) {
  namespace F = torch::nn::functional;
  auto flat = F::cross_entropy(logits.flatten(0, 1).to(torch::kFloat), targets.flatten(),
                               F::CrossEntropyFuncOptions().reduction(torch::kNone));
  return flat.view(targets.sizes()).mean(1);
}

// Continues `prompt` by sampling one character at a time.
std::string sample(GPT& model, const Corpus& corpus, const std::string& prompt, int64_t length, uint64_t seed) {
  torch::NoGradGuard no_grad;
  model->eval();
  // The model may live on a GPU; the characters are drawn on the CPU, from one seeded generator.
  const auto device = model->parameters().front().device();
  auto generator = at::make_generator<at::CPUGeneratorImpl>(seed);
  std::vector<int64_t> ids;
  for (char c : prompt) ids.push_back(static_cast<int64_t>(corpus.alphabet.find(c)));
  std::string text = prompt;
  for (int64_t i = 0; i < length; ++i) {
    const int64_t start = std::max<int64_t>(0, static_cast<int64_t>(ids.size()) - model->block_size);
    auto context = torch::tensor(std::vector<int64_t>(ids.begin() + start, ids.end())).unsqueeze(0).to(device);
    auto probs = model->forward(context).select(1, -1).to(torch::kCPU, torch::kFloat).div(0.8).softmax(-1);
    const int64_t next = at::multinomial(probs, 1, /*replacement=*/false, generator).item<int64_t>();
    ids.push_back(next);
    text += corpus.alphabet[next];
  }
  return text;
}

// The training position saved with every checkpoint.
struct Progress {
  int64_t step = 0;
  nlohmann::json state_dict() const { return {{"step", step}}; }
  void load_state_dict(const nlohmann::json& state) { step = state.at("step").get<int64_t>(); }
};

std::string fixed(double value, int digits = 4) {
  char text[32];
  std::snprintf(text, sizeof text, "%.*f", digits, value);
  return text;
}

std::vector<acc::Tracker> trackers(const std::string& names) {
  std::vector<acc::Tracker> out;
  std::stringstream list(names);
  for (std::string name; std::getline(list, name, ',');) {
    if (!name.empty()) out.emplace_back(name);
  }
  return out;
}

void train(const Settings& s) {
  acc::set_seed(s.seed);

  // One Accelerator holds the processes, the precision, accumulation and the project.
  acc::Accelerator accelerator({
      .mixed_precision = s.mixed_precision,
      .gradient_accumulation_steps = s.gradient_accumulation_steps,
      .dataloader_config = {.use_stateful_dataloader = true},
      .log_with = trackers(s.log_with),
      .project_dir = s.output_dir,
      .project_config = {.logging_dir = s.output_dir + "/logs",
                         .automatic_checkpoint_naming = true,
                         .total_limit = s.total_limit},
      // --tp_size: the processes in groups of tp_size neighbours that split each block; the data
      // is split over the groups.
      // --cp_size: groups of cp_size processes that read the same batch, each its piece of the
      // sequence.
      .parallelism_config = s.tp_size > 1 || s.cp_size > 1
                                ? std::optional<acc::ParallelismConfig>({.tp_size = s.tp_size, .cp_size = s.cp_size})
                                : std::nullopt,
      // SIGTERM or SIGUSR1 (a cluster's preemption, Slurm's --signal=USR1@N): save at the next
      // step and end with status 75; --resume continues from there.
      .preemption = acc::PreemptionKwargs{},
  });
  auto logger = acc::get_logger("char_gpt", "INFO");
  // From --tp_size or from the launcher (--parallelism_config_tp_size).
  const auto mesh = accelerator.torch_device_mesh();
  const int tp_size = mesh ? mesh->size("tp") : 1;
  const int cp_size = mesh ? mesh->size("cp") : 1;

  const Corpus corpus = read_corpus(s.data);
  const int64_t split = corpus.ids.size(0) * 9 / 10;
  auto train_data = windows(corpus.ids.slice(0, 0, split), s.block_size);
  auto val_data = windows(corpus.ids.slice(0, split), s.block_size, s.eval_samples);
  logger.info(c10::str("characters: ", corpus.ids.size(0), ", alphabet: ", corpus.alphabet.size(),
                       ", training windows: ", train_data->size(), ", processes: ", accelerator.num_processes(),
                       ", tensor-parallel size: ", tp_size,
                       tp_size > 1 && s.sequence_parallel ? " (sequence-parallel norms)" : "",
                       ", context-parallel size: ", cp_size,
                       ", mixed precision: ", accelerator.mixed_precision()));

  GPT net(static_cast<int64_t>(corpus.alphabet.size()), s);
  auto optimizer = std::make_shared<torch::optim::AdamW>(
      net->parameters(), torch::optim::AdamWOptions(s.learning_rate).weight_decay(0.01));
  // A prepared scheduler steps once per process for every optimizer step (upstream's rule), so its
  // length counts the steps of all processes.
  auto schedule = acc::get_cosine_schedule_with_warmup(optimizer, s.warmup_steps * accelerator.num_processes(),
                                                       s.max_steps * accelerator.num_processes());
  acc::DataLoader train_loader(train_data, {.batch_size = s.batch_size, .shuffle = true, .drop_last = true});
  acc::DataLoader val_loader(val_data, {.batch_size = s.batch_size});

  // Everything goes through prepare.
  auto [model, opt, train, val, scheduler] = accelerator.prepare(net, optimizer, train_loader, val_loader, schedule);
  auto progress = std::make_shared<Progress>();
  accelerator.register_for_checkpointing(progress);

  // Curves under <output_dir>/logs/char_gpt: `tensorboard --logdir <output_dir>/logs`, or log.jsonl.
  accelerator.init_trackers("char_gpt", {{"n_layer", s.n_layer},
                                         {"n_embd", s.n_embd},
                                         {"n_head", s.n_head},
                                         {"block_size", s.block_size},
                                         {"batch_size", s.batch_size},
                                         {"gradient_accumulation_steps", s.gradient_accumulation_steps},
                                         {"learning_rate", s.learning_rate},
                                         {"max_steps", s.max_steps},
                                         {"processes", accelerator.num_processes()},
                                         {"mixed_precision", accelerator.mixed_precision()}});
  if (s.resume) {
    accelerator.load_state();  // the newest complete checkpoint under
                               // <output_dir>/checkpoints
    logger.info(c10::str("resumed from checkpoint at step ", progress->step));
  }

  auto evaluate = [&] {
    model->eval();
    torch::NoGradGuard no_grad;
    std::vector<torch::Tensor> losses;
    for (auto& batch : val) {
      auto per_sample = loss_per_sample(model(batch.data), batch.target);
      losses.push_back(accelerator.gather_for_metrics(per_sample));
    }
    model->train();
    return torch::cat(losses).mean().item<double>();
  };

  acc::ProgressBar bar({.total = s.max_steps, .desc = "train", .initial = progress->step});
  if (progress->step == 0) {
    const double val_loss = evaluate();
    logger.info(c10::str("step 0: val_loss ", fixed(val_loss)));
    accelerator.log({{"val_loss", val_loss}}, 0);
  }
  double running = 0;
  int64_t running_count = 0;
  // Throughput of the training steps alone (evaluation and checkpoints excluded); loss.item()
  // waits for the device, so each micro-batch's time is its whole time.
  double train_seconds = 0;
  int64_t micro_batches = 0;
  while (progress->step < s.max_steps) {
    for (auto& batch : train) {
      const auto started = std::chrono::steady_clock::now();
      // accumulate skips the gradient synchronisation until the last micro-batch.
      auto sync = accelerator.accumulate(model);
      // Under context parallelism each process of a cp group takes its piece of the sequence (the
      // pieces stay with the batch); the weight makes unequal pieces count by their tokens.
      // The scope ends with the step, before any evaluation.
      {
        auto ids = batch.data, targets = batch.target;
        auto positions = torch::arange(ids.size(1), ids.options()).expand_as(ids).contiguous();
        auto cp = cp_size > 1 ? accelerator.maybe_context_parallel({ids, targets, positions}, {1, 1, 1},
                                                                   {ids, targets, positions})
                              : acc::ContextParallel();
        auto loss = loss_per_sample(model(ids, positions), targets).mean() * cp.loss_weight();
        accelerator.backward(loss);
        running += loss.item<double>();
      }
      ++running_count;
      if (accelerator.sync_gradients()) accelerator.clip_grad_norm_(model->parameters(), 1.0);
      opt.step();
      scheduler.step();
      opt.zero_grad();
      train_seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count();
      ++micro_batches;
      if (!accelerator.sync_gradients()) continue;

      const int64_t step = ++progress->step;
      bar.update();
      bar.set_postfix("loss=" + fixed(running / running_count, 3));
      if (step % s.eval_every == 0 || step == s.max_steps) {
        const double val_loss = evaluate();
        logger.info(c10::str("step ", step, ": train_loss ", fixed(running / running_count), ", val_loss ",
                             fixed(val_loss), ", lr ", scheduler.get_last_lr()[0]));
        accelerator.log({{"train_loss", running / running_count},
                         {"val_loss", val_loss},
                         {"learning_rate", scheduler.get_last_lr()[0]}},
                        step);
        running = 0;
        running_count = 0;
      }
      if (step % s.checkpoint_every == 0 || step == s.max_steps) {
        const std::string folder = accelerator.save_state();
        logger.info(c10::str("step ", step, ": saved ", folder));
      }
      if (step >= s.max_steps) break;
    }
  }
  bar.close();
  accelerator.end_training();
  if (micro_batches > 0) {
    // The processes of a tensor- or context-parallel group train on the same batch.
    const int64_t replicas = accelerator.num_processes() / (tp_size * cp_size);
    const double tokens = static_cast<double>(micro_batches * s.batch_size * s.block_size * replicas);
    logger.info(c10::str("throughput: ", static_cast<int64_t>(tokens / train_seconds), " tokens/s over ",
                         accelerator.num_processes(), " process(es) on ", accelerator.device(), " (", micro_batches,
                         " micro-batches in ", fixed(train_seconds, 1), " s; evaluation and checkpoints excluded)"));
  }

  // The whole weights, gathered from every process (sharded, split by tensor parallelism or not),
  // into a model of one process; the main process samples from it.
  const auto weights = accelerator.get_state_dict(model);
  if (accelerator.is_main_process()) {
    Settings one_process = s;
    one_process.tp_size = 1;
    GPT trained(static_cast<int64_t>(corpus.alphabet.size()), one_process);
    {
      torch::NoGradGuard no_grad;
      for (auto& item : trained->named_parameters()) item.value().copy_(weights[item.key()]);
      for (auto& item : trained->named_buffers()) item.value().copy_(weights[item.key()]);
    }
    trained->to(accelerator.device());
    const std::string text = sample(trained, corpus, "ROMEO:\n", s.sample_length, s.seed);
    std::cout << "---- sample ----\n" << text << "\n";
  }
  accelerator.wait_for_everyone();
}

}  // namespace

int main(int argc, char** argv) {
  const Settings settings = parse_settings(argc, argv);
  try {
    train(settings);
  } catch (const c10::Error& e) {  // LibTorch's errors carry a C++ backtrace; the message is enough
    std::cerr << "char_gpt: error: " << e.what_without_backtrace() << std::endl;
    return 1;
  }
  return 0;
}
