// A fuzz target for `Accelerator::load_state`: a whole checkpoint folder (model, optimizer,
// scheduler, sampler, a registered object, the random states) in which one file is replaced by
// the input. Whatever the bytes, the load must either succeed or raise a c10::Error, and a load
// that raises must leave every object as it was (weights, optimizer state, scheduler, sampler,
// registered object, generator). Anything else — another exception, a crash, a sanitizer report,
// an object changed by a refused load — aborts.
//
// The input is one byte choosing the file (its index, modulo the number of files) followed by
// the file's new content. Built two ways from this one source: with clang's libFuzzer
// (`-fsanitize=fuzzer`, which supplies main), or, by default, with the small driver at the end,
// which mutates the saved files itself (`load_state_fuzzer <iterations> [seed]`, or
// `--seconds N`) and is what the test suite and scripts/fuzz.sh run in the sanitizer build.
// With `--python` (or ACCELERATE_FUZZ_LAYOUT=python) the checkpoint is saved in Python
// Accelerate's layout (optimizer.bin, scheduler.bin, random_states_0.pkl, … in torch.save's zip
// archives), whose reader is then the one under test. With `--dcp` (ACCELERATE_FUZZ_LAYOUT=dcp)
// the model's and the optimizer's states are then replaced by the torch.distributed.checkpoint
// folders upstream's FSDP writes (a pickled .metadata, items at offsets in __0_0.distcp), which
// load_state reads whole into a job without FSDP, and one mutation in two of a .metadata rewrites
// one of its small integers (offsets, lengths, sizes, chunk boundaries).
#include <accelerate/accelerate.h>

#include "checkpoint/dcp_state.h"
#include "checkpoint/torch_save.h"

#include <torch/torch.h>

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <map>
#include <random>
#include <string>
#include <vector>

namespace acc = accelerate;
namespace fs = std::filesystem;

namespace {

std::string fuzz_layout() {
  const char* layout = std::getenv("ACCELERATE_FUZZ_LAYOUT");
  return layout != nullptr ? layout : "";
}
bool dcp_layout() { return fuzz_layout() == "dcp"; }
bool python_layout() { return fuzz_layout() == "python" || dcp_layout(); }

// Replaces a Python-layout folder's model.safetensors and optimizer.bin with the
// torch.distributed.checkpoint folders upstream's FSDP writes for them (a one-process job, so each
// tensor is one chunk), which a job without FSDP loads whole.
void to_dcp_folders(const fs::path& folder, const torch::nn::Module& net) {
  namespace ck = acc::detail::checkpoint;
  using Path = std::vector<acc::detail::dcp::PathStep>;
  const acc::PartialState state;
  ck::DcpShare model;
  std::vector<std::string> names;
  for (const auto& item : net.named_parameters()) {
    const auto& t = item.value();
    model.tensors["model." + item.key()] = {t.detach(), t.sizes().vec(), std::vector<int64_t>(t.dim(), 0),
                                            Path{std::string("model"), item.key()}};
    names.push_back(item.key());
  }
  ck::write_dcp_folder(folder / "pytorch_model_fsdp_0", model, state);
  fs::remove(folder / "model.safetensors");
  // optimizer.bin as PyTorch wrote it: "state.<i>.<name>" tensors (steps included), param groups.
  const auto py = ck::read_torch_save((folder / "optimizer.bin").string());
  ck::DcpShare optimizer;
  for (const auto& [key, t] : py.tensors) {
    const auto dot = key.rfind('.');
    const auto& param = names.at(std::stoul(key.substr(6, dot - 6)));
    const auto name = key.substr(dot + 1);
    optimizer.tensors["optimizer.state." + param + "." + name] = {
        t, t.sizes().vec(), std::vector<int64_t>(t.dim(), 0), Path{std::string("optimizer"), std::string("state"), param, name}};
  }
  int64_t g = 0;
  for (const auto& group : py.values.at("param_groups")) {
    for (const auto& [option, value] : group.items()) {
      auto v = value;
      if (option == "params") {
        v = nlohmann::json::array();
        for (const auto& p : value) v.push_back(names.at(p.get<size_t>()));
      }
      optimizer.values["optimizer.param_groups." + std::to_string(g) + "." + option] = {
          v, Path{std::string("optimizer"), std::string("param_groups"), g, option}};
    }
    ++g;
  }
  ck::write_dcp_folder(folder / "optimizer_0", optimizer, state);
  fs::remove(folder / "optimizer.bin");
}

struct Counter {
  int64_t value = 7;
  nlohmann::json state_dict() const { return {{"value", value}, {"tag", "counter"}}; }
  void load_state_dict(const nlohmann::json& state) { value = state.at("value").get<int64_t>(); }
};

std::string read_all(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

void write_all(const fs::path& path, const std::string& bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
}

[[noreturn]] void broken(const std::string& what) {
  std::fprintf(stderr, "invariant broken: %s\n", what.c_str());
  std::abort();
}

// Everything a load may change, to compare before and after a refused one.
struct Observed {
  std::vector<at::Tensor> weights;
  nlohmann::json optimizer_values;
  std::map<std::string, at::Tensor> optimizer_tensors;
  nlohmann::json scheduler;
  std::string sampler;
  int64_t counter = 0;
  at::Tensor generator;
};

// The training objects, a folder with their checkpoint, and the scratch folder loads read.
struct Setup {
  acc::Accelerator accelerator;
  torch::nn::Linear net{3, 2};
  std::shared_ptr<torch::optim::Adam> adam = std::make_shared<torch::optim::Adam>(net->parameters(), 0.01);
  std::shared_ptr<acc::LambdaLR> schedule =
      std::make_shared<acc::LambdaLR>(adam, [](int64_t epoch) { return 1.0 / (1.0 + static_cast<double>(epoch)); });
  acc::DataLoader loader{std::make_shared<acc::TensorDataset>(torch::randn({8, 3}), torch::randn({8, 2})),
                         {.batch_size = 4, .shuffle = true}};
  Counter counter;
  fs::path root;
  std::vector<std::string> names;  // the checkpoint's files, sorted
  std::vector<std::string> seeds;  // their saved bytes

  Setup() {
    std::string tmpl = (fs::temp_directory_path() / "accelerate-fuzz-XXXXXX").string();
    root = ::mkdtemp(tmpl.data());
    auto [model, opt, data, sched] = accelerator.prepare(net, adam, loader, schedule);
    accelerator.register_for_checkpointing(counter);
    for (auto& batch : data) {
      opt.zero_grad();
      accelerator.backward(torch::mse_loss(model(batch.data), batch.target));
      opt.step();
    }
    sched.step();
    accelerator.save_state((root / "seed").string(),
                           {.layout = python_layout() ? acc::CheckpointLayout::kPython : acc::CheckpointLayout::kCpp});
    if (dcp_layout()) to_dcp_folders(root / "seed", *net);
    for (const auto& entry : fs::recursive_directory_iterator(root / "seed")) {
      if (entry.is_regular_file()) names.push_back(entry.path().lexically_relative(root / "seed").string());
    }
    std::sort(names.begin(), names.end());
    for (const auto& name : names) seeds.push_back(read_all(root / "seed" / name));
    fs::copy(root / "seed", root / "load", fs::copy_options::recursive);
  }
  ~Setup() { fs::remove_all(root); }

  Observed observe() const {
    Observed o;
    for (const auto& p : net->parameters()) o.weights.push_back(p.detach().clone());
    const auto optimizer = acc::optimizer_state_dict(*adam);
    o.optimizer_values = optimizer.values;
    for (const auto& [name, tensor] : optimizer.tensors) o.optimizer_tensors[name] = tensor.clone();
    o.scheduler = schedule->state_dict();
    o.sampler = loader.state_dict().to_json();
    o.counter = counter.value;
    o.generator = at::detail::getDefaultCPUGenerator().get_state();
    return o;
  }
};

Setup& setup() {
  static Setup* s = [] {
    setenv("ACCELERATE_LOG_LEVEL", "ERROR", /*overwrite=*/0);  // warnings about odd files are expected here
    return new Setup();
  }();
  return *s;
}

// Equal values, NaN equal to NaN (an earlier load may have put NaN in place).
bool same_values(const at::Tensor& a, const at::Tensor& b) {
  if (a.sizes() != b.sizes() || a.scalar_type() != b.scalar_type()) return false;
  if (!a.is_floating_point()) return torch::equal(a, b);
  return at::isclose(a, b, /*rtol=*/0, /*atol=*/0, /*equal_nan=*/true).all().item<bool>();
}

bool same(const Observed& a, const Observed& b) {
  if (a.weights.size() != b.weights.size() || a.optimizer_values != b.optimizer_values ||
      a.scheduler != b.scheduler || a.sampler != b.sampler || a.counter != b.counter ||
      !same_values(a.generator, b.generator) || a.optimizer_tensors.size() != b.optimizer_tensors.size()) {
    return false;
  }
  for (size_t i = 0; i < a.weights.size(); ++i) {
    if (!same_values(a.weights[i], b.weights[i])) return false;
  }
  for (const auto& [name, tensor] : a.optimizer_tensors) {
    auto it = b.optimizer_tensors.find(name);
    if (it == b.optimizer_tensors.end() || !same_values(tensor, it->second)) return false;
  }
  return true;
}

// Loads the checkpoint with file `index` replaced by `bytes`, checking the invariants; returns
// whether the load was refused.
bool load_with(size_t index, const std::string& bytes) {
  auto& s = setup();
  const auto folder = s.root / "load";
  for (size_t i = 0; i < s.names.size(); ++i) write_all(folder / s.names[i], i == index ? bytes : s.seeds[i]);
  const Observed before = s.observe();
  try {
    s.accelerator.load_state(folder.string());
  } catch (const c10::Error& e) {
    if (!same(before, s.observe())) {
      write_all(s.root.parent_path() / "load_state_fuzzer.crash", std::string(1, static_cast<char>(index)) + bytes);
      broken("a refused load of a mutated " + s.names[index] + " changed an object (the input is in " +
             (s.root.parent_path() / "load_state_fuzzer.crash").string() + "); the error: " + e.what_without_backtrace());
    }
    return true;
  } catch (const std::exception& e) {
    broken("load_state raised something other than a c10::Error for a mutated " + s.names[index] + ": " + e.what());
  }
  return false;
}

// Zip's CRC-32 (the polynomial of zlib), for archives whose records were edited in place.
uint32_t zip_crc32(const char* data, size_t size) {
  static const auto table = [] {
    std::vector<uint32_t> t(256);
    for (uint32_t n = 0; n < 256; ++n) {
      uint32_t c = n;
      for (int k = 0; k < 8; ++k) c = (c & 1) ? 0xEDB88320u ^ (c >> 1) : c >> 1;
      t[n] = c;
    }
    return t;
  }();
  uint32_t c = 0xffffffffu;
  for (size_t i = 0; i < size; ++i) c = table[(c ^ static_cast<unsigned char>(data[i])) & 0xff] ^ (c >> 8);
  return c ^ 0xffffffffu;
}

uint32_t le32(const std::string& b, size_t at) {
  uint32_t v = 0;
  for (int i = 3; i >= 0; --i) v = (v << 8) | static_cast<unsigned char>(b[at + i]);
  return v;
}

void put_le32(std::string& b, size_t at, uint32_t v) {
  for (int i = 0; i < 4; ++i) b[at + i] = static_cast<char>((v >> (8 * i)) & 0xff);
}

// Recomputes the CRC of every stored record of a zip archive (local headers and central
// directory), so that an edit inside a record reaches the record's reader.
void fix_zip_crcs(std::string& zip) {
  std::map<std::string, uint32_t> crcs;
  for (size_t at = 0; at + 30 <= zip.size() && le32(zip, at) == 0x04034b50;) {
    const size_t name = static_cast<unsigned char>(zip[at + 26]) | static_cast<unsigned char>(zip[at + 27]) << 8;
    const size_t extra = static_cast<unsigned char>(zip[at + 28]) | static_cast<unsigned char>(zip[at + 29]) << 8;
    const size_t size = le32(zip, at + 18);
    const size_t data = at + 30 + name + extra;
    if (data + size > zip.size()) return;
    const auto crc = zip_crc32(zip.data() + data, size);
    put_le32(zip, at + 14, crc);
    crcs[zip.substr(at + 30, name)] = crc;
    at = data + size;
  }
  for (size_t at = zip.find("PK\x01\x02"); at != std::string::npos && at + 46 <= zip.size();
       at = zip.find("PK\x01\x02", at + 4)) {
    const size_t name = static_cast<unsigned char>(zip[at + 28]) | static_cast<unsigned char>(zip[at + 29]) << 8;
    const auto it = crcs.find(zip.substr(at + 46, name));
    if (it != crcs.end()) put_le32(zip, at + 16, it->second);
  }
}

// A generator state that does not fit its generator: cut, lengthened or of another dtype (the
// project's random_states_<p>.safetensors), or of another size in the pickle (Python's
// random_states_<p>.pkl, whose CPU state is a tensor of 5056 bytes: BININT2 0x13c0).
std::string mutate_generator(const std::string& name, const std::string& bytes, std::mt19937_64& random) {
  if (name.size() > 12 && name.substr(name.size() - 12) == ".safetensors") {
    const auto scratch = setup().root / "generator.safetensors";
    write_all(scratch, bytes);
    auto state = acc::load_state_dict_file(scratch.string());
    auto& generator = state.tensors.at("torch_manual_seed");
    switch (random() % 3) {
      // Cut below 5000 bytes: LibTorch's CPU generator also takes a legacy state of 5048.
      case 0: generator = generator.slice(0, 0, static_cast<int64_t>(random() % 5000)).clone(); break;
      case 1: generator = torch::cat({generator, generator.slice(0, 0, 1 + random() % 16)}); break;
      default: generator = generator.to(random() % 2 ? torch::kInt : torch::kFloat); break;
    }
    acc::save_state_dict_file(state, scratch.string());
    return read_all(scratch);
  }
  std::string out = bytes;
  const auto size = out.find("M\xc0\x13");
  if (size == std::string::npos) return out.substr(0, out.size() / 2);  // a cut archive, refused too
  const auto smaller = static_cast<uint16_t>(random() % 5000);
  out[size + 1] = static_cast<char>(smaller & 0xff);
  out[size + 2] = static_cast<char>(smaller >> 8);
  fix_zip_crcs(out);
  return out;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  const auto& s = setup();
  load_with(data[0] % s.names.size(), std::string(reinterpret_cast<const char*>(data) + 1, size - 1));
  return 0;
}

#ifndef ACCELERATE_LIBFUZZER
// The driver without libFuzzer: each iteration mutates one saved file with a few random edits
// (bit flips, bytes set to edge values, cuts, insertions, a digit or a JSON value swapped for
// another kind) and loads it; every 16th iteration loads the unmutated checkpoint, which must
// succeed. Deterministic for a given seed.
int main(int argc, char** argv) {
  int64_t iterations = 500;
  double seconds = 0;
  uint64_t seed = 1;
  for (int i = 1; i < argc; ++i) {
    if (std::strcmp(argv[i], "--seconds") == 0 && i + 1 < argc) {
      seconds = std::atof(argv[++i]);
    } else if (std::strcmp(argv[i], "--python") == 0) {
      setenv("ACCELERATE_FUZZ_LAYOUT", "python", /*overwrite=*/1);
    } else if (std::strcmp(argv[i], "--dcp") == 0) {
      setenv("ACCELERATE_FUZZ_LAYOUT", "dcp", /*overwrite=*/1);
    } else if (i == 1) {
      iterations = std::atoll(argv[i]);
    } else {
      seed = std::strtoull(argv[i], nullptr, 10);
    }
  }
  std::printf("load_state_fuzzer: seed %llu, %s layout\n", static_cast<unsigned long long>(seed),
              dcp_layout() ? "Python's with torch.distributed.checkpoint folders"
                           : python_layout() ? "Python's" : "the project's");
  auto& s = setup();
  std::string files;
  for (const auto& name : s.names) files += (files.empty() ? "" : ", ") + name;
  std::printf("load_state_fuzzer: the checkpoint's files: %s\n", files.c_str());
  std::fflush(stdout);
  std::mt19937_64 random(seed);
  const auto pick = [&](size_t n) { return static_cast<size_t>(random() % n); };
  const auto start = std::chrono::steady_clock::now();
  int64_t done = 0, refused = 0;
  static const std::vector<std::string> replacements = {"\"x\"", "-1", "1e308", "null", "[]", "{}", "true",
                                                        "18446744073709551616", "0", "\"\""};
  while (seconds > 0 ? std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count() < seconds
                     : done < iterations) {
    ++done;
    const size_t index = pick(s.names.size());
    std::string bytes = s.seeds[index];
    if (done % 16 == 0) {
      try {
        s.accelerator.load_state((s.root / "seed").string());
      } catch (const std::exception& e) {
        broken(std::string("the unmutated checkpoint no longer loads: ") + e.what());
      }
      continue;
    }
    if (s.names[index].rfind("random_states_", 0) == 0 && pick(2) == 0) {
      // One in two mutations of the generators' file is a state that does not fit its generator.
      if (load_with(index, mutate_generator(s.names[index], bytes, random))) {
        ++refused;
      } else {
        broken("a generator state that does not fit its generator was loaded from " + s.names[index]);
      }
      continue;
    }
    const auto& name = s.names[index];
    if (name.size() > 9 && name.substr(name.size() - 9) == ".metadata" && pick(2) == 0) {
      // One of the pickle's small integers (BININT1 'K', BININT2 'M': offsets, lengths, sizes,
      // chunk boundaries) set to another value.
      std::vector<size_t> ints;
      for (size_t at = 0; at + 2 < bytes.size(); ++at) {
        if (bytes[at] == 'K' || bytes[at] == 'M') ints.push_back(at);
      }
      if (!ints.empty()) {
        const size_t at = ints[pick(ints.size())];
        bytes[at + 1] = static_cast<char>(std::vector<int>{0, 1, 2, 3, 0x7f, 0xff}[pick(6)] + (random() % 2) * pick(256));
        if (bytes[at] == 'M') bytes[at + 2] = static_cast<char>(pick(2) == 0 ? 0 : random());
      }
      if (load_with(index, bytes)) ++refused;
      continue;
    }
    const size_t edits = 1 + pick(4);
    for (size_t e = 0; e < edits; ++e) {
      const size_t at = bytes.empty() ? 0 : pick(bytes.size());
      switch (pick(7)) {
        case 0:
          if (!bytes.empty()) bytes[at] = static_cast<char>(bytes[at] ^ (1 << pick(8)));
          break;
        case 1:
          if (!bytes.empty()) bytes[at] = static_cast<char>(std::vector<int>{0, 0x7f, 0x80, 0xff, '"', '{'}[pick(6)]);
          break;
        case 2:
          bytes.resize(at);
          break;
        case 3:
          bytes.insert(at, std::string(1 + pick(16), static_cast<char>(random())));
          break;
        case 4:  // the safetensors header length
          if (bytes.size() >= 8) bytes[pick(8)] = static_cast<char>(random());
          break;
        case 5: {  // a digit for another
          const auto digit = bytes.find_first_of("0123456789", at);
          if (digit != std::string::npos) bytes[digit] = static_cast<char>('0' + pick(10));
          break;
        }
        default: {  // a JSON value for one of another kind
          const auto colon = bytes.find(':', at);
          if (colon == std::string::npos) break;
          const auto end = bytes.find_first_of(",}", colon);
          if (end == std::string::npos) break;
          bytes.replace(colon + 1, end - colon - 1, replacements[pick(replacements.size())]);
          break;
        }
      }
    }
    if (load_with(index, bytes)) ++refused;
  }
  std::printf("load_state_fuzzer: %lld loads of mutated checkpoints, %lld refused, every refusal left every object "
              "as it was\n",
              static_cast<long long>(done), static_cast<long long>(refused));
  return 0;
}
#endif
