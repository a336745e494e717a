// torch.save's format read and written without Python: the pickle reader's refusals and round
// trips (formats/pickle), files written by Debian's PyTorch read back value for value and tensor
// for tensor (checkpoint/torch_save), each optimizer kind's state crossing in both directions and
// continuing the same training, and what is refused by name: the legacy format, a truncated
// archive, a storage too small for its tensor, a Python class, maximize=True, a lambda's state.
#include "accelerate/accelerate.h"
#include "checkpoint/python_layout.h"
#include "checkpoint/torch_save.h"
#include "formats/pickle.h"
#include "support/accelerators.h"
#include "support/process.h"
#include "support/test_support.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <caffe2/serialize/inline_container.h>
#include <sys/wait.h>
#include <torch/torch.h>
#include <unistd.h>

#include <filesystem>
#include <cstring>
#include <fstream>
#include <functional>

namespace accelerate::testing {
namespace {

namespace fs = std::filesystem;
namespace pickle = detail::pickle;
using ::testing::HasSubstr;
using namespace std::string_literals;

constexpr const char* kPython = "/usr/bin/python3";

// Runs Python `code` with `args` as sys.argv[1:]; its standard output.
std::string python(const std::string& code, const std::vector<std::string>& args = {}) {
  std::vector<std::string> argv = {kPython, "-c", "import sys, json, collections, torch\n" + code};
  argv.insert(argv.end(), args.begin(), args.end());
  auto r = run(argv, 120);
  EXPECT_EQ(r->exit_code(), 0) << r->err;
  return r->out;
}

std::string pickle_error(std::string_view bytes) {
  try {
    pickle::read(bytes);
  } catch (const std::invalid_argument& e) {
    return e.what();
  }
  return "accepted";
}

// ---- the pickle reader and writer -----------------------------------------------------------

TEST(Pickle, WrittenValuesReadBackTheSame) {
  pickle::Tree t;
  const auto* big = t.integer(int64_t{1} << 40);
  const auto* root = t.dict({{t.string("ints"), t.list({t.integer(0), t.integer(255), t.integer(256), t.integer(65536),
                                                        t.integer(-1), t.integer(-129), big,
                                                        t.integer(INT64_MIN), t.integer(INT64_MAX)})},
                             {t.string("tuple"), t.tuple({t.none(), t.boolean(true), t.number(-2.5)})},
                             {t.integer(7), t.tuple({t.string("h\xc3\xa9"), t.tuple({}), t.dict({})})},
                             {t.string("call"), t.call(t.global("collections", "OrderedDict"), t.tuple({}))}});
  const auto bytes = pickle::write(*root);
  const auto back = pickle::read(bytes);
  EXPECT_TRUE(pickle::same(*root, *back.root));
  EXPECT_EQ(back.root->entries[0].second->items[7]->integer, INT64_MIN);
  // Python's own pickle module reads the same values.
  TempDir dir;
  detail::write_file(dir.str() + "/p.pkl", bytes);
  const auto printed = python("import pickle; print(pickle.loads(open(sys.argv[1], 'rb').read()))", {dir.str() + "/p.pkl"});
  EXPECT_THAT(printed, HasSubstr("'ints': [0, 255, 256, 65536, -1, -129, 1099511627776, -9223372036854775808, "
                                 "9223372036854775807]"));
  EXPECT_THAT(printed, HasSubstr("7: ('hé', (), {})"));
  EXPECT_THAT(printed, HasSubstr("'call': OrderedDict()"));
}

TEST(Pickle, MalformedPicklesAreRefusedNamingTheRule) {
  EXPECT_THAT(pickle_error(""s), HasSubstr("ends before its STOP opcode"));
  EXPECT_THAT(pickle_error("\x80\x02K\x01"s), HasSubstr("ends before its STOP opcode"));
  EXPECT_THAT(pickle_error("\x80\x02K\x01.K"s), HasSubstr("bytes follow the STOP opcode"));
  EXPECT_THAT(pickle_error("\x80\x09N."s), HasSubstr("protocol 9 is newer than 5"));
  EXPECT_THAT(pickle_error("\xff."s), HasSubstr("unknown opcode 0xff"));
  EXPECT_THAT(pickle_error("h\x05."s), HasSubstr("entry 5, which was never stored"));
  EXPECT_THAT(pickle_error("\x8a\x09\x01\x02\x03\x04\x05\x06\x07\x08\x09."s),
              HasSubstr("beyond 64 bits"));
  EXPECT_THAT(pickle_error("X\xff\xff\xff\x7f."s), HasSubstr("runs past the end of the pickle"));
  EXPECT_THAT(pickle_error("}(K\x01u."s), HasSubstr("odd number of values"));
  EXPECT_THAT(pickle_error("K\x01K\x02."s), HasSubstr("STOP leaves 2 values"));
  EXPECT_THAT(pickle_error("R."s), HasSubstr("needs a value the stack lacks"));
  EXPECT_THAT(pickle_error("cos\nsystem\nK\x01R."s), HasSubstr("arguments are not a tuple"));
  EXPECT_THAT(pickle_error("Fl.0\n."s), HasSubstr("FLOAT is not read"));
  EXPECT_THAT(pickle_error("\x82\x01."s), HasSubstr("extension registry"));
  // A global is only a name: reading one calls and imports nothing.
  const auto tree = pickle::read("cos\nsystem\nX\x02\x00\x00\x00ls\x85R."s);
  EXPECT_EQ(tree.root->kind, pickle::Value::Kind::kCall);
  EXPECT_EQ(tree.root->callable->qualified_name(), "os.system");
}

TEST(Pickle, AListThatContainsItselfIsReadButNotWalkedForever) {
  // EMPTY_LIST, BINPUT 0, BINGET 0, APPEND: a list that holds itself.
  const auto tree = pickle::read("]q\x00h\x00" "a."s);
  EXPECT_EQ(tree.root->items.at(0), tree.root);
  EXPECT_THROWS_WITH(pickle::write(*tree.root), "nested deeper than 100");
  // Doubling through the memo: 40 levels of (x, x) make 2^40 places out of 40 values.
  std::string doubling = "N";
  for (int i = 0; i < 40; ++i) doubling += "q\x00h\x00\x86"s;
  doubling += '.';
  const auto shared = pickle::read(doubling);
  EXPECT_LT(shared.size(), 200u);
  EXPECT_EQ(pickle::expanded_size(*shared.root, 1000), 1000u);
}

// ---- files of torch.save ----------------------------------------------------------------------

TEST(TorchSave, FilesOfPyTorchAreReadValueForValueAndTensorForTensor) {
  TempDir dir;
  const auto path = dir.str() + "/values.bin";
  python(R"(
base = torch.arange(24, dtype=torch.float32).reshape(4, 6)
obj = {
  "floats": base,
  "view": base[1:, ::2],            # an offset and strides into a shared storage
  "same_storage": base[0],
  "dtypes": [torch.tensor([1.5, -2.0], dtype=d) for d in (torch.float64, torch.float16, torch.bfloat16)],
  "ints": torch.tensor([-3, 2**40]), "bools": torch.tensor([True, False]), "bytes": torch.tensor([0, 255], dtype=torch.uint8),
  "scalar": torch.tensor(7.0), "empty": torch.zeros(0, 3),
  "plain": {"none": None, "t": (1, 2.5, "x"), "big": 2**62, "neg": -5, "flag": False},
  "by_index": {0: 1, 1: 2},
  "ordered": collections.OrderedDict([("b", 1), ("a", 2)]),
}
torch.save(obj, sys.argv[1])
)",
         {path});
  const auto state = detail::checkpoint::read_torch_save(path);
  const auto& t = state.tensors;
  EXPECT_TRUE(at::equal(t.at("floats"), at::arange(24, at::kFloat).reshape({4, 6})));
  EXPECT_TRUE(at::equal(t.at("view"), at::arange(24, at::kFloat).reshape({4, 6}).slice(0, 1).slice(1, 0, 6, 2)));
  EXPECT_TRUE(at::equal(t.at("same_storage"), at::arange(6, at::kFloat)));
  EXPECT_EQ(t.at("dtypes.0").scalar_type(), at::kDouble);
  EXPECT_EQ(t.at("dtypes.1").scalar_type(), at::kHalf);
  EXPECT_EQ(t.at("dtypes.2").scalar_type(), at::kBFloat16);
  EXPECT_EQ(t.at("dtypes.2")[1].item<float>(), -2.0f);
  EXPECT_EQ(t.at("ints")[1].item<int64_t>(), int64_t{1} << 40);
  EXPECT_EQ(t.at("bools").scalar_type(), at::kBool);
  EXPECT_EQ(t.at("bytes")[1].item<int>(), 255);
  EXPECT_EQ(t.at("scalar").dim(), 0);
  EXPECT_EQ(t.at("empty").sizes(), at::IntArrayRef({0, 3}));
  const auto& v = state.values;
  EXPECT_EQ(v.at("plain"), nlohmann::json::parse(R"({"none": null, "t": [1, 2.5, "x"], "big": 4611686018427387904,
                                                     "neg": -5, "flag": false})"));
  EXPECT_EQ(v.at("by_index"), nlohmann::json::parse(R"({"0": 1, "1": 2})"));
  EXPECT_EQ(v.at("ordered").dump(), R"({"a":2,"b":1})");
  EXPECT_EQ(v.at("dtypes"), nlohmann::json::parse("[null, null, null]"));
  EXPECT_FALSE(v.contains("floats"));
}

TEST(TorchSave, WhatIsNotAPlainStateIsRefusedByName) {
  TempDir dir;
  const auto p = [&](const char* name) { return dir.str() + "/" + name; };
  python(R"(
torch.save(collections.Counter(a=1), sys.argv[1])
torch.save({"w": torch.ones(3)}, sys.argv[2], _use_new_zipfile_serialization=False)
torch.save({"w": torch.ones(1000)}, sys.argv[3])
import zipfile
src = zipfile.ZipFile(sys.argv[3])
with zipfile.ZipFile(sys.argv[4], "w") as out:   # the same archive, its storage cut to 100 floats
    for name in src.namelist():
        data = src.read(name)
        out.writestr(name, data[:400] if name.endswith("data/0") else data)
torch.save({"s": {1, 2}}, sys.argv[5])
)",
         {p("counter.bin"), p("legacy.bin"), p("whole.bin"), p("short.bin"), p("set.bin")});
  EXPECT_THROWS_WITH(detail::checkpoint::read_torch_save(p("counter.bin")), "an object of collections.Counter, which is not read");
  EXPECT_THROWS_WITH(detail::checkpoint::read_torch_save(p("legacy.bin")), "the legacy format");
  EXPECT_THROWS_WITH(detail::checkpoint::read_torch_save(p("short.bin")), "should hold 1000 elements of float32 but its record holds 400 bytes");
  EXPECT_THROWS_WITH(detail::checkpoint::read_torch_save(p("set.bin")), "\"s\" holds an object of __builtin__.set");
  // Cut in the middle: the archive's directory is gone.
  const auto whole = detail::read_file(p("whole.bin"));
  detail::write_file(p("cut.bin"), whole.substr(0, whole.size() / 2));
  EXPECT_THROWS_WITH(detail::checkpoint::read_torch_save(p("cut.bin")), "cut.bin is not a valid torch.save archive");
  detail::write_file(p("text.bin"), "not an archive");
  EXPECT_THROWS_WITH(detail::checkpoint::read_torch_save(p("text.bin")), "is not a zip archive written by torch.save");
  // load_state_dict reads a model's .bin, and only tensors.
  EXPECT_TRUE(at::equal(load_state_dict(p("whole.bin")).at("w"), at::ones(1000)));
  EXPECT_THROWS_WITH(load_state_dict(p("counter.bin")), "[load_state_dict]");
}

// What running `fn` in a child process raised its peak resident memory by, in bytes, and its
// error ("accepted" when it raised none). The child's peak is reset first (clear_refs), so what
// it shares with this process does not count.
std::pair<int64_t, std::string> peak_and_error(const std::function<void()>& fn) {
  int pipe_fds[2];
  EXPECT_EQ(pipe(pipe_fds), 0);
  const auto kib = [](const char* field) {
    std::ifstream status("/proc/self/status");
    std::string line;
    while (std::getline(status, line)) {
      if (line.rfind(field, 0) == 0) return std::stoll(line.substr(std::strlen(field)));
    }
    return -1LL;
  };
  const pid_t pid = fork();
  if (pid == 0) {
    close(pipe_fds[0]);
    std::ofstream("/proc/self/clear_refs") << "5";
    const auto before = kib("VmRSS:");
    std::string error = "accepted";
    try {
      fn();
    } catch (const std::exception& e) {
      error = e.what();
    }
    const auto grown = (kib("VmHWM:") - before) * 1024;
    const auto out = std::to_string(grown) + "\n" + error.substr(0, 4000);
    (void)!write(pipe_fds[1], out.data(), out.size());
    _exit(0);
  }
  close(pipe_fds[1]);
  std::string out;
  char buffer[4096];
  for (ssize_t n; (n = read(pipe_fds[0], buffer, sizeof buffer)) > 0;) out.append(buffer, n);
  close(pipe_fds[0]);
  int status = 0;
  waitpid(pid, &status, 0);
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << "the child died: status " << status;
  const auto newline = out.find('\n');
  if (newline == std::string::npos) return {-1, "the child wrote nothing"};
  return {std::stoll(out.substr(0, newline)), out.substr(newline + 1)};
}

// A torch.save archive whose data.pkl is `pickle` (and `records` beside it), written by LibTorch.
void write_archive(const std::string& path, const std::string& pickle,
                   const std::vector<std::pair<std::string, std::string>>& records = {}) {
  caffe2::serialize::PyTorchStreamWriter archive(path);
  archive.writeRecord("data.pkl", pickle.data(), pickle.size());
  for (const auto& [name, bytes] : records) archive.writeRecord(name, bytes.data(), bytes.size());
  archive.writeEndOfFile();
}

// Note [torch.save files] in torch_save.cpp: about 232 bytes per byte of
// data.pkl and 64 MiB, plus the file's records; 32 MiB more for the allocator's own ways.
int64_t read_bound(const std::string& path, size_t pickle_size) {
  return 232 * static_cast<int64_t>(pickle_size) + (int64_t{64} << 20) +
         static_cast<int64_t>(fs::file_size(path)) + (int64_t{32} << 20);
}

TEST(TorchSave, CallsNestedDeeperThanValuesAreRefusedWithoutExhaustingTheStack) {
  TempDir dir;
  // _rebuild_parameter(_rebuild_parameter(…)), 20 000 deep: each level a memo reference to the
  // global, a MARK, the inner call, TUPLE and REDUCE.
  const int depth = 20000;
  // The global itself, kept on the stack by BINPUT, is the outermost callable.
  std::string pkl = "\x80\x02" "ctorch._utils\n_rebuild_parameter\nq\x00"s;
  const std::string inner = "h\x00)R"s;
  for (int i = 1; i < depth; ++i) pkl += "(h\x00"s;
  pkl += "(" + inner;
  for (int i = 0; i < depth; ++i) pkl += "tR";
  pkl += ".";
  const auto path = dir.str() + "/optimizer.bin";
  write_archive(path, pkl);
  const auto [peak, error] = peak_and_error([&] { detail::checkpoint::read_torch_save(path); });
  EXPECT_THAT(error, HasSubstr("values nested deeper than 100"));
  EXPECT_LT(peak, read_bound(path, pkl.size()));
}

TEST(TorchSave, CompressedRecordsAreRefusedBeforeTheyAreInflated) {
  TempDir dir;
  const auto p = [&](const char* name) { return dir.str() + "/" + name; };
  // A data.pkl of 4 MiB of EMPTY_LIST and a storage of 256 MiB, each deflated to kilobytes; and a
  // stored version record of 1 MiB.
  python(R"(
import zipfile
def archive(path, records, method):
    with zipfile.ZipFile(path, "w", compression=method) as out:
        for name, data in records:
            out.writestr("archive/" + name, data)
lists = b"\x80\x02" + b"]" * (4 << 20)
archive(sys.argv[1], [("data.pkl", lists), ("version", b"3\n")], zipfile.ZIP_DEFLATED)
tensor = (b"\x80\x02ctorch._utils\n_rebuild_tensor_v2\n((X\x07\x00\x00\x00storage"
          b"ctorch\nByteStorage\nX\x01\x00\x00\x000X\x03\x00\x00\x00cpuJ\x00\x00\x00\x10tQK\x00J\x00\x00\x00\x10\x85K\x01\x85\x89)tR.")
archive(sys.argv[2], [("data.pkl", tensor), ("data/0", bytes(256 << 20)), ("version", b"3\n")], zipfile.ZIP_DEFLATED)
archive(sys.argv[3], [("data.pkl", b"\x80\x02K\x07."), ("version", b"3" * (1 << 20))], zipfile.ZIP_STORED)
)",
         {p("lists.bin"), p("storage.bin"), p("version.bin")});
  EXPECT_LT(fs::file_size(p("lists.bin")), 64u << 10);
  EXPECT_LT(fs::file_size(p("storage.bin")), 1u << 20);
  for (const char* name : {"lists.bin", "storage.bin"}) {
    SCOPED_TRACE(name);
    const auto [peak, error] = peak_and_error([&] { detail::checkpoint::read_torch_save(p(name)); });
    EXPECT_THAT(error, HasSubstr("is compressed (method 8); torch.save stores its records uncompressed"));
    EXPECT_LT(peak, int64_t{16} << 20);
  }
  // A long version record is the archive reader's to judge; it costs no more than the file.
  const auto [peak, error] = peak_and_error([&] { detail::checkpoint::read_torch_save(p("version.bin")); });
  EXPECT_LT(peak, read_bound(p("version.bin"), 5));
  // A directory that claims more than the file holds.
  auto bytes = detail::read_file(p("version.bin"));
  const auto end = bytes.rfind("PK\x05\x06"s);
  ASSERT_NE(end, std::string::npos);
  bytes[end + 12] = '\xff';  // the directory's size
  bytes[end + 13] = '\xff';
  bytes[end + 14] = '\xff';
  detail::write_file(p("directory.bin"), bytes);
  EXPECT_THROWS_WITH(detail::checkpoint::read_torch_save(p("directory.bin")), "reaches past the end of the file");
}

TEST(TorchSave, AKeySharedByEveryLevelOrAStringSharedEverywhereCostsABoundedMultipleOfTheFile) {
  TempDir dir;
  const auto p = [&](const char* name) { return dir.str() + "/" + name; };
  // {K: {K: {… {K: 1}}}} 99 levels deep with one key K of 256 KiB, memoized: the paths of the
  // levels once cost |K|·99²/2 (1.2 GB); now each level costs its copy of K in the values.
  const std::string key(256 << 10, 'k');
  std::string nested = "\x80\x02}X"s;
  const auto le32 = [](uint32_t n) { return std::string{char(n & 255), char(n >> 8 & 255), char(n >> 16 & 255), char(n >> 24)}; };
  nested += le32(key.size()) + key + "q\x01"s;
  for (int i = 1; i < 99; ++i) nested += "}h\x01"s;
  nested += "K\x01";
  for (int i = 1; i < 99; ++i) nested += "s";
  nested += "s.";
  write_archive(p("nested.bin"), nested);
  auto [peak, error] = peak_and_error([&] {
    const auto state = detail::checkpoint::read_torch_save(p("nested.bin"));
    const auto* level = &state.values;
    int depth = 0;
    while (level->is_object()) {
      level = &level->at(key);
      ++depth;
    }
    if (depth != 99 || *level != 1) throw std::runtime_error("read wrongly: " + std::to_string(depth) + " levels");
  });
  EXPECT_EQ(error, "accepted");
  EXPECT_LT(peak, read_bound(p("nested.bin"), nested.size()));
  // One string of 512 KiB in a list 100 000 times through the memo: 51 GB once copied.
  std::string shared = "\x80\x02](X"s + le32(512 << 10) + std::string(512 << 10, 's') + "q\x01"s;
  for (int i = 1; i < 100000; ++i) shared += "h\x01"s;
  shared += "e.";
  write_archive(p("shared.bin"), shared);
  std::tie(peak, error) = peak_and_error([&] { detail::checkpoint::read_torch_save(p("shared.bin")); });
  EXPECT_THAT(error, HasSubstr("values that expand to more than"));
  EXPECT_LT(peak, read_bound(p("shared.bin"), shared.size()));
}

TEST(TorchSave, WrittenFilesAreReadByPyTorchWithWeightsOnly) {
  TempDir dir;
  const auto path = dir.str() + "/written.bin";
  detail::checkpoint::TorchSaveWriter w;
  auto& t = w.tree();
  auto strided = at::arange(12, at::kFloat).reshape({3, 4}).t();  // not contiguous
  const auto* root = t.dict({{t.string("a"), w.tensor(strided)},
                             {t.string("h"), w.tensor(at::tensor({1.5, -2.0}).to(at::kHalf))},
                             {t.string("j"), w.from_json(nlohmann::json::parse(R"({"x": [1, 2.5, null, true, "s"]})"))},
                             {t.integer(3), w.ordered_dict({{t.string("k"), t.integer(-7)}})}});
  w.write(root, path);
  const auto out = python(R"(
major = int(torch.__version__.split(".")[0])
o = torch.load(sys.argv[1], weights_only=True) if major >= 2 else torch.load(sys.argv[1])
print(json.dumps({"a": o["a"].tolist(), "a_shape": list(o["a"].shape), "h": [str(o["h"].dtype), o["h"].tolist()],
                  "j": o["j"], "k": o[3]["k"], "ordered": type(o[3]).__name__}))
)",
                          {path});
  const auto found = nlohmann::json::parse(out);
  EXPECT_EQ(found["a_shape"], nlohmann::json::parse("[4, 3]"));
  EXPECT_EQ(found["a"][1], nlohmann::json::parse("[1.0, 5.0, 9.0]"));
  EXPECT_EQ(found["h"], nlohmann::json::parse(R"(["torch.float16", [1.5, -2.0]])"));
  EXPECT_EQ(found["j"], nlohmann::json::parse(R"({"x": [1, 2.5, null, true, "s"]})"));
  EXPECT_EQ(found["k"], -7);
  EXPECT_EQ(found["ordered"], "OrderedDict");
  // And the project reads its own files back.
  const auto back = detail::checkpoint::read_torch_save(path);
  EXPECT_TRUE(at::equal(back.tensors.at("a"), strided));
}

// ---- optimizers crossing in both directions -----------------------------------------------------

// The Python side: one step of `kind` on a Linear(3, 2) with fixed weights and gradients, its state
// saved; with `load`, the state C++ wrote is loaded instead; then one more step, the parameters
// after it printed.
const char* kOptimizerScript = R"(
kind, save, load = sys.argv[1], sys.argv[2], sys.argv[3]
net = torch.nn.Linear(3, 2)
with torch.no_grad():
    net.weight.copy_(torch.arange(6.0).reshape(2, 3) / 10); net.bias.copy_(torch.tensor([0.5, -0.5]))
make = {"sgd": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, nesterov=True, weight_decay=0.01),
        "adam": lambda p: torch.optim.Adam(p, lr=0.01, amsgrad=True),
        "adamw": lambda p: torch.optim.AdamW(p, lr=0.01, weight_decay=0.1),
        "adagrad": lambda p: torch.optim.Adagrad(p, lr=0.1, lr_decay=0.01),
        "rmsprop": lambda p: torch.optim.RMSprop(p, lr=0.01, momentum=0.5, centered=True)}[kind]
opt = make(net.parameters())
def step(scale):
    opt.zero_grad()
    for i, p in enumerate(net.parameters()):
        p.grad = torch.cos(torch.arange(p.numel(), dtype=torch.float32) * (i + 1) * scale).reshape(p.shape)
    opt.step()
if load == "-":
    step(1.0)
    torch.save(opt.state_dict(), save)
    torch.save(net.state_dict(), save + ".model.bin")
else:
    major = int(torch.__version__.split(".")[0])
    opt.load_state_dict(torch.load(load, weights_only=True) if major >= 2 else torch.load(load))
    net.load_state_dict(torch.load(save + ".model.bin"))
step(2.0)
print(json.dumps([p.detach().flatten().tolist() for p in net.parameters()]))
)";

std::shared_ptr<torch::optim::Optimizer> make_optimizer(const std::string& kind, torch::nn::Linear& net) {
  using namespace torch::optim;
  const auto p = net->parameters();
  if (kind == "sgd") return std::make_shared<SGD>(p, SGDOptions(0.1).momentum(0.9).nesterov(true).weight_decay(0.01));
  if (kind == "adam") return std::make_shared<Adam>(p, AdamOptions(0.01).amsgrad(true));
  if (kind == "adamw") return std::make_shared<AdamW>(p, AdamWOptions(0.01).weight_decay(0.1));
  if (kind == "adagrad") return std::make_shared<Adagrad>(p, AdagradOptions(0.1).lr_decay(0.01));
  return std::make_shared<RMSprop>(p, RMSpropOptions(0.01).momentum(0.5).centered(true));
}

void gradient_step(torch::nn::Linear& net, torch::optim::Optimizer& opt, double scale) {
  opt.zero_grad();
  int i = 0;
  for (auto& p : net->parameters()) {
    ++i;
    p.mutable_grad() = torch::cos(torch::arange(p.numel(), torch::kFloat) * i * scale).reshape(p.sizes()).clone();
  }
  opt.step();
}

std::vector<std::vector<float>> params_of(torch::nn::Linear& net) {
  std::vector<std::vector<float>> out;
  for (auto& p : net->parameters()) {
    auto c = p.detach().contiguous();
    out.emplace_back(c.data_ptr<float>(), c.data_ptr<float>() + c.numel());
  }
  return out;
}

void expect_close(const nlohmann::json& python_params, const std::vector<std::vector<float>>& cpp_params) {
  ASSERT_EQ(python_params.size(), cpp_params.size());
  for (size_t i = 0; i < cpp_params.size(); ++i) {
    ASSERT_EQ(python_params[i].size(), cpp_params[i].size());
    for (size_t j = 0; j < cpp_params[i].size(); ++j) {
      EXPECT_NEAR(python_params[i][j].get<double>(), cpp_params[i][j], 1e-6) << "parameter " << i << "[" << j << "]";
    }
  }
}

class OptimizerCrossing : public ::testing::TestWithParam<std::string> {};

TEST_P(OptimizerCrossing, PythonsStateContinuesInCppAndCppsInPython) {
  const auto kind = GetParam();
  TempDir dir;
  const auto saved = dir.str() + "/optimizer.bin";
  // Python's first step, then its second: what C++ must reach from Python's state.
  const auto python_after = nlohmann::json::parse(python(kOptimizerScript, {kind, saved, "-"}));
  torch::nn::Linear net(3, 2);
  for (auto& [name, tensor] : load_state_dict(saved + ".model.bin")) {
    torch::NoGradGuard no_grad;
    net->named_parameters()[name].copy_(tensor);
  }
  auto opt = make_optimizer(kind, net);
  load_optimizer_state_dict(*opt, detail::checkpoint::python_layout::read_optimizer(saved, *opt));
  gradient_step(net, *opt, 2.0);
  expect_close(python_after, params_of(net));

  // C++'s first step, its state written in Python's layout and continued by Python.
  torch::nn::Linear fresh(3, 2);
  {
    torch::NoGradGuard no_grad;
    fresh->weight.copy_(torch::arange(6, torch::kFloat).reshape({2, 3}) / 10);
    fresh->bias.copy_(torch::tensor({0.5f, -0.5f}));
  }
  auto cpp_opt = make_optimizer(kind, fresh);
  gradient_step(fresh, *cpp_opt, 1.0);
  const auto written = dir.str() + "/from_cpp.bin";
  detail::checkpoint::python_layout::write_optimizer(optimizer_state_dict(*cpp_opt), written);
  detail::checkpoint::TorchSaveWriter model;
  model.write(model.ordered_dict({{model.tree().string("weight"), model.tensor(fresh->weight)},
                                  {model.tree().string("bias"), model.tensor(fresh->bias)}}),
              written + ".model.bin");
  const auto python_resumed = nlohmann::json::parse(python(kOptimizerScript, {kind, written, written}));
  gradient_step(fresh, *cpp_opt, 2.0);
  expect_close(python_resumed, params_of(fresh));
}

INSTANTIATE_TEST_SUITE_P(EachKind, OptimizerCrossing, ::testing::Values("sgd", "adam", "adamw", "adagrad", "rmsprop"));

TEST(OptimizerCrossing, WhatLibTorchCannotDoIsRefusedByName) {
  TempDir dir;
  python(R"(
net = torch.nn.Linear(2, 1)
opt = torch.optim.Adam(net.parameters(), maximize=True)
torch.save(opt.state_dict(), sys.argv[1])
sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda e: 1.0)
state = sched.state_dict(); state["lr_lambdas"] = [{"factor": 2}]
torch.save(state, sys.argv[2])
)",
         {dir.str() + "/maximize.bin", dir.str() + "/lambda.bin"});
  torch::nn::Linear net(2, 1);
  auto adam = std::make_shared<torch::optim::Adam>(net->parameters(), torch::optim::AdamOptions(1e-3));
  EXPECT_THROWS_WITH(detail::checkpoint::python_layout::read_optimizer(dir.str() + "/maximize.bin", *adam),
                     "the optimizer maximizes (maximize=True), which LibTorch's Adam cannot");
  LambdaLR schedule(adam, [](int64_t) { return 1.0; });
  EXPECT_THROWS_WITH(detail::checkpoint::python_layout::read_scheduler(dir.str() + "/lambda.bin", schedule),
                     "lr_lambdas[0] holds a callable object's attributes {\"factor\":2}");
  OneCycleLR cycle(adam, {.max_lr = 0.1, .total_steps = 10});
  EXPECT_THROWS_WITH(detail::checkpoint::python_layout::write_scheduler(cycle, dir.str() + "/cycle.bin"),
                     "only LambdaLR schedulers");
  EXPECT_THROWS_WITH(detail::checkpoint::python_layout::read_scheduler(dir.str() + "/lambda.bin", cycle),
                     "PyTorch keeps a OneCycleLR's rate and momentum bounds (initial_lr, max_lr, min_lr, "
                     "max_momentum, base_momentum) in the optimizer's param groups");
  // LBFGS: refused both ways, with the reason, before a file is read or written.
  auto lbfgs = std::make_shared<torch::optim::LBFGS>(net->parameters(), torch::optim::LBFGSOptions(0.5));
  EXPECT_THROWS_WITH(detail::checkpoint::python_layout::read_optimizer(dir.str() + "/maximize.bin", *lbfgs),
                     "LBFGS's state is not read from Python's files: PyTorch keeps LBFGS's history");
  EXPECT_THROWS_WITH(detail::checkpoint::python_layout::write_optimizer(optimizer_state_dict(*lbfgs),
                                                                        dir.str() + "/lbfgs.bin"),
                     "LBFGS's state is not written in Python's layout: PyTorch keeps LBFGS's history");
  EXPECT_FALSE(std::filesystem::exists(dir.path() / "lbfgs.bin"));
}

}  // namespace
}  // namespace accelerate::testing

namespace accelerate::testing {
namespace {

struct Tally {
  int64_t count = 3;
  double rate = 0.25;
  at::Tensor history = torch::arange(4, torch::kFloat);
  StateDict state_dict() const { return {{{"count", count}, {"rate", rate}}, {{"history", history}}}; }
  void load_state_dict(const StateDict& s) {
    count = s.values.at("count").get<int64_t>();
    rate = s.values.at("rate").get<double>();
    history = s.tensors.at("history").clone();
  }
};

TEST(PythonLayout, RegisteredObjectsTheScalerAndTheStepCrossAndComeBack) {
  TempDir dir;
  const auto folder = dir.str() + "/ckpt";
  Tally tally;
  run_accelerators(1, [&](const Accelerator& acc, int) {
    torch::nn::Linear net(3, 2);
    auto sgd = std::make_shared<torch::optim::SGD>(net->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
    auto [model, opt] = acc.prepare(net, sgd);
    acc.register_for_checkpointing(tally);
    for (int i = 0; i < 2; ++i) {
      auto guard = acc.accumulate(model);
      opt.zero_grad();
      acc.backward(model(torch::ones({2, 3})).sum());
      opt.step();
    }
    acc.save_state(folder, {.layout = CheckpointLayout::kPython});
    EXPECT_FALSE(fs::exists(fs::path(folder) / "optimizer.safetensors"));
    EXPECT_TRUE(fs::is_regular_file(fs::path(folder) / "custom_checkpoint_0.pkl"));
    // What Python's load_state hands to each object.
    const auto seen = nlohmann::json::parse(python(R"(
major = int(torch.__version__.split(".")[0])
load = (lambda p: torch.load(p, weights_only=True)) if major >= 2 else torch.load
custom = load(sys.argv[1] + "/custom_checkpoint_0.pkl")
states = load(sys.argv[1] + "/random_states_0.pkl")
import random, numpy
random.setstate(states["random_state"]); numpy.random.set_state(states["numpy_random_seed"])
torch.set_rng_state(states["torch_manual_seed"])
print(json.dumps({"count": custom["count"], "rate": custom["rate"], "history": custom["history"].tolist(),
                  "step": states["step"], "draw": torch.rand(2).tolist()}))
)",
                                                   {folder}));
    EXPECT_EQ(seen["count"], 3);
    EXPECT_EQ(seen["rate"], 0.25);
    EXPECT_EQ(seen["history"], nlohmann::json::parse("[0.0, 1.0, 2.0, 3.0]"));
    EXPECT_EQ(seen["step"], 2);
    const auto draw = torch::rand({2});
    // Python's generator continues where this process's did.
    EXPECT_EQ(seen["draw"][0].get<double>(), static_cast<double>(draw[0].item<float>()));

    tally.count = 0;
    tally.history.zero_();
    acc.load_state(folder);  // the layout detected
    EXPECT_EQ(tally.count, 3);
    EXPECT_TRUE(at::equal(tally.history, torch::arange(4, torch::kFloat)));
    EXPECT_EQ(acc.step(), 2);
  });

  // The scaler's state as Python's GradScaler.state_dict() holds it, and back.
  const auto scaler = dir.str() + "/scaler.pt";
  const nlohmann::json state = {{"scale", 1024.0}, {"growth_factor", 2.0}, {"backoff_factor", 0.5},
                                {"growth_interval", 100}, {"_growth_tracker", 7}};
  detail::checkpoint::python_layout::write_scaler(state, scaler);
  const auto printed = python(R"(
state = torch.load(sys.argv[1])
print(json.dumps({k: state[k] for k in sorted(state)}))
)",
                              {scaler});
  EXPECT_EQ(nlohmann::json::parse(printed), state);
  EXPECT_EQ(detail::checkpoint::python_layout::read_scaler(scaler), state);
}

TEST(LoadState, AGeneratorStateThatDoesNotFitIsRefusedNamingItsFileBeforeAnythingChanges) {
  TempDir dir;
  Tally tally;
  run_accelerators(1, [&](const Accelerator& acc, int) {
    torch::nn::Linear net(3, 2);
    auto sgd = std::make_shared<torch::optim::SGD>(net->parameters(), torch::optim::SGDOptions(0.1));
    auto [model, opt] = acc.prepare(net, sgd);
    acc.register_for_checkpointing(tally);
    const auto train = [&] {
      opt.zero_grad();
      acc.backward(model(torch::ones({2, 3})).sum());
      opt.step();
    };
    for (const auto layout : {CheckpointLayout::kCpp, CheckpointLayout::kPython}) {
      SCOPED_TRACE(to_string(layout));
      const auto folder = dir.str() + "/" + to_string(layout);
      train();
      acc.save_state(folder, {.layout = layout});
      // A generator state of ten bytes, as a hand-edited or foreign file might hold.
      const auto random = folder + (layout == CheckpointLayout::kPython ? "/random_states_0.pkl"
                                                                        : "/random_states_0.safetensors");
      StateDict generators;
      generators.tensors["torch_manual_seed"] = torch::zeros({10}, torch::kUInt8);
      if (layout == CheckpointLayout::kPython) {
        detail::checkpoint::python_layout::write_random(generators, acc.step(), random);
      } else {
        generators.values["step"] = acc.step();
        save_state_dict_file(generators, random);
      }
      train();
      tally.count = 11;
      const auto weight = model->weight.clone();
      const auto step = acc.step();
      const auto generator = rng_state_dict().tensors.at("torch_manual_seed");
      EXPECT_THROWS_WITH(acc.load_state(folder), random + ": [load_rng_state_dict] torch_manual_seed is not a state");
      EXPECT_TRUE(torch::equal(model->weight, weight)) << "the model was loaded";
      EXPECT_EQ(tally.count, 11) << "the registered object was loaded";
      EXPECT_EQ(acc.step(), step);
      EXPECT_TRUE(torch::equal(rng_state_dict().tensors.at("torch_manual_seed"), generator));
      // Of another dtype: refused the same way.
      generators.tensors["torch_manual_seed"] = rng_state_dict().tensors.at("torch_manual_seed").to(torch::kInt);
      if (layout == CheckpointLayout::kPython) {
        detail::checkpoint::python_layout::write_random(generators, acc.step(), random);
      } else {
        save_state_dict_file(generators, random);
      }
      EXPECT_THROWS_WITH(acc.load_state(folder), random + ": [load_rng_state_dict] torch_manual_seed should be a 1-D "
                                                          "uint8 tensor on the CPU, got Int");
      EXPECT_TRUE(torch::equal(model->weight, weight));
      EXPECT_EQ(tally.count, 11);
    }
  });
}

TEST(PythonLayout, AModelInPickledShardsWithTheirIndexLoads) {
  TempDir dir;
  const auto folder = dir.str() + "/ckpt";
  // A folder as upstream's save_state writes it with safe_serialization=False, the model cut into
  // two pytorch_model-0000i-of-00002.bin files with their index (save_model's sharded variant).
  python(R"(
import os, random, numpy
folder = sys.argv[1]; os.makedirs(folder)
net = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))
with torch.no_grad():
    for i, p in enumerate(net.parameters()): p.copy_(torch.full(p.shape, float(i + 1)))
state = net.state_dict(); names = list(state)
shards = {"pytorch_model-00001-of-00002.bin": names[:2], "pytorch_model-00002-of-00002.bin": names[2:]}
for file, keys in shards.items(): torch.save({k: state[k] for k in keys}, os.path.join(folder, file))
json.dump({"metadata": {"total_size": 4 * sum(v.numel() for v in state.values())},
           "weight_map": {k: f for f, keys in shards.items() for k in keys}},
          open(os.path.join(folder, "pytorch_model.bin.index.json"), "w"))
opt = torch.optim.SGD(net.parameters(), lr=0.5)
torch.save(opt.state_dict(), os.path.join(folder, "optimizer.bin"))
torch.save({"step": 9, "random_state": random.getstate(), "numpy_random_seed": numpy.random.get_state(),
            "torch_manual_seed": torch.get_rng_state(), "torch_cuda_manual_seed": []},
           os.path.join(folder, "random_states_0.pkl"))
)",
         {folder});
  run_accelerators(1, [&](const Accelerator& acc, int) {
    torch::nn::Sequential net(torch::nn::Linear(3, 4), torch::nn::Linear(4, 2));
    auto sgd = std::make_shared<torch::optim::SGD>(net->parameters(), torch::optim::SGDOptions(0.1));
    auto [model, opt] = acc.prepare(net, sgd);
    acc.load_state(folder);
    int i = 0;
    for (const auto& p : net->parameters()) {
      ++i;
      EXPECT_TRUE(at::equal(p, at::full(p.sizes(), static_cast<float>(i)))) << "parameter " << i;
    }
    EXPECT_EQ(i, 4);
    EXPECT_EQ(static_cast<torch::optim::SGDOptions&>(sgd->param_groups()[0].options()).lr(), 0.5);
    EXPECT_EQ(acc.step(), 9);
    // One shard missing: refused naming it, and nothing changes.
    fs::remove(fs::path(folder) / "pytorch_model-00002-of-00002.bin");
    {
      torch::NoGradGuard no_grad;
      for (auto& p : net->parameters()) p.zero_();
    }
    EXPECT_THROWS_WITH(acc.load_state(folder), "pytorch_model-00002-of-00002.bin does not exist");
    for (const auto& p : net->parameters()) EXPECT_EQ(p.abs().sum().item<float>(), 0.0f);
    EXPECT_EQ(static_cast<torch::optim::SGDOptions&>(sgd->param_groups()[0].options()).lr(), 0.5);
  });
}

TEST(PythonLayout, SavingWhatPythonsLayoutCannotHoldIsRefusedBeforeWriting) {
  TempDir dir;
  run_accelerators(1, [&](const Accelerator& acc, int) {
    torch::nn::Linear net(3, 2);
    auto adam = std::make_shared<torch::optim::Adam>(net->parameters(), 0.01);
    auto cycle = std::make_shared<OneCycleLR>(adam, OneCycleLROptions{.max_lr = 0.1, .total_steps = 10});
    auto [model, opt, sched] = acc.prepare(net, adam, cycle);
    EXPECT_THROWS_WITH(acc.save_state(dir.str() + "/ckpt", {.layout = CheckpointLayout::kPython}),
                       "scheduler 0 is not a LambdaLR");

    EXPECT_FALSE(fs::exists(dir.path() / "ckpt"));
    EXPECT_THROWS_WITH(acc.save_state(dir.str() + "/ckpt", {.layout = CheckpointLayout::kDetect}),
                       "kDetect is for loading");
  });
  // An LBFGS: refused on every process before anything is written (a sharded optimizer's folder
  // is written by all processes together).
  run_accelerators(1, [&](const Accelerator& acc, int) {
    torch::nn::Linear net(3, 2);
    auto [model, opt] =
        acc.prepare(net, std::make_shared<torch::optim::LBFGS>(net->parameters(), torch::optim::LBFGSOptions(0.5)));
    EXPECT_THROWS_WITH(acc.save_state(dir.str() + "/lbfgs", {.layout = CheckpointLayout::kPython}),
                       "optimizer 0 is an LBFGS, whose state is not written in Python's layout: PyTorch keeps");
    EXPECT_FALSE(fs::exists(dir.path() / "lbfgs"));
  });
}

TEST(AcceleratorSave, WithoutSafeSerializationWritesTorchSaveFilesThatPythonLoads) {
  TempDir dir;
  const auto tensors = dir.str() + "/weights.bin", values = dir.str() + "/values.bin", safe = dir.str() + "/w.st";
  run_accelerators(1, [&](const Accelerator& acc, int) {
    TensorMap map{{"b", torch::arange(3, torch::kFloat)}, {"a", torch::ones({2, 2}, torch::kBFloat16)}};
    acc.save(map, tensors, /*safe_serialization=*/false);
    acc.save(nlohmann::json{{"epoch", 3}, {"names", {"x", "y"}}}, values, /*safe_serialization=*/false);
    acc.save(map, safe);
  });
  const auto seen = nlohmann::json::parse(python(R"(
major = int(torch.__version__.split(".")[0])
load = (lambda p: torch.load(p, weights_only=True)) if major >= 2 else torch.load
w = load(sys.argv[1]); v = load(sys.argv[2])
print(json.dumps({"type": type(w).__name__, "keys": list(w.keys()), "b": w["b"].tolist(), "a": str(w["a"].dtype),
                  "values": v}))
)",
                                                 {tensors, values}));
  EXPECT_EQ(seen["type"], "OrderedDict");
  EXPECT_EQ(seen["keys"], nlohmann::json::parse(R"(["a", "b"])"));
  EXPECT_EQ(seen["b"], nlohmann::json::parse("[0.0, 1.0, 2.0]"));
  EXPECT_EQ(seen["a"], "torch.bfloat16");
  EXPECT_EQ(seen["values"], nlohmann::json::parse(R"({"epoch": 3, "names": ["x", "y"]})"));
  // The library reads its own torch.save file back; the default stays safetensors.
  EXPECT_TRUE(torch::equal(load_state_dict(tensors).at("b"), torch::arange(3, torch::kFloat)));
  EXPECT_TRUE(torch::equal(load_file(safe).at("b"), torch::arange(3, torch::kFloat)));
}

// Upstream's accelerate.utils.save / load: torch.save's format by default, which Python reads
// with weights_only; safetensors and JSON when asked; load reads all three back, and Python's own
// torch.save files of tensors and plain values.
TEST(UtilsSaveLoad, TorchSaveByDefaultSafetensorsOrJsonWhenAskedAndLoadReadsEveryKind) {
  TempDir dir;
  const auto bin = dir.str() + "/w.bin", st = dir.str() + "/w.safetensors", json = dir.str() + "/v.json",
             values = dir.str() + "/v.bin";
  const TensorMap map{{"b", torch::arange(3, torch::kFloat)}, {"a", torch::ones({2, 2}, torch::kBFloat16)}};
  utils::save(map, bin);
  utils::save(map, st, {.safe_serialization = true});
  utils::save(nlohmann::json{{"epoch", 3}}, json, {.safe_serialization = true});
  utils::save(nlohmann::json{{"epoch", 3}, {"names", {"x", "y"}}}, values);
  EXPECT_EQ(SafetensorsFile(st).metadata(), (SafetensorsMetadata{{"format", "pt"}}));
  const auto seen = nlohmann::json::parse(python(R"(
major = int(torch.__version__.split(".")[0])
load = (lambda p: torch.load(p, weights_only=True)) if major >= 2 else torch.load
w = load(sys.argv[1])
torch.save({"step": 7, "rates": [0.5, 0.25], "weight": torch.full((2,), 4.0)}, sys.argv[3])
print(json.dumps({"type": type(w).__name__, "b": w["b"].tolist(), "values": load(sys.argv[2])}))
)",
                                                 {bin, values, dir.str() + "/python.bin"}));
  EXPECT_EQ(seen["type"], "OrderedDict");
  EXPECT_EQ(seen["b"], nlohmann::json::parse("[0.0, 1.0, 2.0]"));
  EXPECT_EQ(seen["values"], nlohmann::json::parse(R"({"epoch": 3, "names": ["x", "y"]})"));
  for (const auto& path : {bin, st}) {
    const auto back = utils::load(path);
    ASSERT_EQ(back.tensors.size(), 2u) << path;
    EXPECT_TRUE(torch::equal(back.tensors.at("b"), map.at("b"))) << path;
    EXPECT_EQ(back.tensors.at("a").scalar_type(), torch::kBFloat16) << path;
  }
  EXPECT_EQ(utils::load(json).values, nlohmann::json::parse(R"({"epoch": 3})"));
  EXPECT_EQ(utils::load(values).values, nlohmann::json::parse(R"({"epoch": 3, "names": ["x", "y"]})"));
  const auto python_file = utils::load(dir.str() + "/python.bin", c10::Device(c10::kCPU));
  EXPECT_EQ(python_file.values, nlohmann::json::parse(R"({"step": 7, "rates": [0.5, 0.25]})"));
  EXPECT_TRUE(torch::equal(python_file.tensors.at("weight"), torch::full({2}, 4.0)));
  EXPECT_THROWS_WITH(utils::load(dir.str() + "/nothing.bin"), "does not exist");
  detail::write_file(dir.str() + "/bad.safetensors", "not a file of any kind");
  EXPECT_THROWS_WITH(utils::load(dir.str() + "/bad.safetensors"), "bad.safetensors");
}

TEST(Constants, NameTheFilesOfUpstreamsLayoutThatSaveStateWritesAndLoadStateDetects) {
  // Upstream's values (accelerate/utils/constants.py): a Python script ported to C++ keeps them.
  EXPECT_EQ(WEIGHTS_NAME, std::string(MODEL_NAME) + ".bin");
  EXPECT_EQ(WEIGHTS_INDEX_NAME, std::string(WEIGHTS_NAME) + ".index.json");
  EXPECT_EQ(SAFE_WEIGHTS_NAME, std::string(SAFE_MODEL_NAME) + ".safetensors");
  EXPECT_EQ(SAFE_WEIGHTS_INDEX_NAME, std::string(SAFE_WEIGHTS_NAME) + ".index.json");
  EXPECT_EQ(MODEL_NAME, "pytorch_model");
  EXPECT_EQ(SCALER_NAME, "scaler.pt");
  TempDir dir;
  const fs::path folder = dir.str() + "/ckpt";
  run_accelerators(1, [&](const Accelerator& acc, int) {
    torch::nn::Linear net(3, 2);
    auto sgd = std::make_shared<torch::optim::SGD>(net->parameters(), 0.1);
    auto [model, opt] = acc.prepare(net, sgd);
    acc.save_state(folder.string(), {.layout = CheckpointLayout::kPython});
  });
  std::set<std::string> files;
  for (const auto& entry : fs::directory_iterator(folder)) files.insert(entry.path().filename().string());
  EXPECT_EQ(files, (std::set<std::string>{std::string(SAFE_WEIGHTS_NAME), std::string(OPTIMIZER_NAME) + ".bin",
                                          std::string(RNG_STATE_NAME) + "_0.pkl"}));
}

}  // namespace
}  // namespace accelerate::testing
