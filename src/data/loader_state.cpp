// A loader's state: `DataLoader::state_dict`/`load_state_dict` and `DataLoaderState` as JSON
// (upstream: the state dict of a StatefulDataLoader, and the sampler's epoch and generator).
#include "data/loader_state.h"

#include "data/data_loader.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <mutex>
#include <nlohmann/json.hpp>

namespace accelerate {
namespace detail::data {
namespace {

int hex_digit(char c) {
  if (c >= '0' && c <= '9') return c - '0';
  if (c >= 'a' && c <= 'f') return c - 'a' + 10;
  if (c >= 'A' && c <= 'F') return c - 'A' + 10;
  return -1;
}

bool is_hex(const std::string& text) {
  return text.size() % 2 == 0 && std::all_of(text.begin(), text.end(), [](char c) { return hex_digit(c) >= 0; });
}

}  // namespace

std::string generator_state_hex(at::Generator generator) {
  at::Tensor state;
  {
    std::lock_guard<std::mutex> lock(generator.mutex());
    state = generator.get_state();
  }
  static const char* digits = "0123456789abcdef";
  const auto* bytes = state.contiguous().data_ptr<uint8_t>();
  std::string out;
  out.reserve(static_cast<size_t>(state.numel()) * 2);
  for (int64_t i = 0; i < state.numel(); ++i) {
    out.push_back(digits[bytes[i] >> 4]);
    out.push_back(digits[bytes[i] & 0xF]);
  }
  return out;
}

void set_generator_state_hex(at::Generator generator, const std::string& hex, const char* api) {
  TORCH_CHECK_VALUE(is_hex(hex), "[", api, "] expected the generator state as an even number of hex digits, got ",
                    hex.size(), " characters");
  auto state = at::empty({static_cast<int64_t>(hex.size() / 2)}, at::kByte);
  auto* bytes = state.data_ptr<uint8_t>();
  for (size_t i = 0; i < hex.size() / 2; ++i) {
    bytes[i] = static_cast<uint8_t>(hex_digit(hex[2 * i]) * 16 + hex_digit(hex[2 * i + 1]));
  }
  std::lock_guard<std::mutex> lock(generator.mutex());
  try {
    generator.set_state(state);
  } catch (const c10::Error& e) {
    C10_THROW_ERROR(ValueError, c10::str("[", api, "] the generator refused the saved state (", state.numel(),
                      " bytes): ", e.what_without_backtrace()));
  }
}

// The processes whose batches a position of this loader counts (DataLoaderState::num_processes):
// those of a prepared loader that deals the whole order's batches out in turn (a sharded batch
// sampler, a sharded iterable dataset, a dispatcher without split_batches); 1 when each process's
// batches are slices of whole ones, or the loader is not prepared.
int64_t position_shards(const DataLoaderImpl& L) {
  if (L.kind == LoaderKind::kPlain || L.split_batches) return 1;
  return L.state ? L.state->num_processes() : L.num_processes;
}

}  // namespace detail::data

DataLoaderState DataLoader::state_dict() const {
  const auto& L = *impl_;
  const auto generator = detail::data::generator_of(L);
  const auto current_generator = [&] { return generator ? detail::data::generator_state_hex(*generator) : std::string(); };
  DataLoaderState state;
  state.num_processes = detail::data::position_shards(L);
  if (L.in_pass && !L.end_of_dataloader) {
    // Mid-pass: the order is replayed from the generator as it was when the pass started.
    state.epoch = L.iteration;
    state.batches_yielded = L.position;
    state.generator_state = L.pass_generator_state;
  } else if (L.in_pass) {
    // On the last batch: resuming starts the next pass, from the generator as it is now.
    state.epoch = L.iteration + 1;
    state.iterator_finished = true;
    state.generator_state = current_generator();
  } else {
    state.epoch = L.iteration;
    state.batches_yielded = L.resume_position.value_or(0);
    state.iterator_finished = L.last_pass_finished;
    state.generator_state = current_generator();
  }
  return state;
}

void DataLoader::load_state_dict(const DataLoaderState& state) const {
  auto& L = *impl_;
  TORCH_CHECK_VALUE(state.epoch >= 0 && state.batches_yielded >= 0,
                    "[DataLoader::load_state_dict] expected a non-negative epoch and batch count, got epoch ",
                    state.epoch, " and batches_yielded ", state.batches_yielded);
  const auto generator = detail::data::generator_of(L);
  TORCH_CHECK_VALUE(state.generator_state.empty() || generator.has_value(),
                    "[DataLoader::load_state_dict] the state holds a generator state, but this loader's sampler has "
                    "no generator (was the state saved from a loader that shuffles?)");
  TORCH_CHECK_VALUE(!state.generator_state.empty() || !generator.has_value(),
                    "[DataLoader::load_state_dict] this loader's sampler draws from a generator, but the state holds "
                    "no generator state (was the state saved from a loader that does not shuffle?)");
  if (generator) detail::data::set_generator_state_hex(*generator, state.generator_state, "DataLoader::load_state_dict");
  // A position saved by another number of processes: the same place in the whole order.
  int64_t position = state.batches_yielded;
  const int64_t shards = detail::data::position_shards(L);
  if (state.num_processes > 0 && state.num_processes != shards && position > 0) {
    const int64_t whole = position * state.num_processes;
    TORCH_CHECK_VALUE(whole % shards == 0, "[DataLoader::load_state_dict] the state stands at batch ", position,
                      " of each of ", state.num_processes, " processes (batch ", whole,
                      " of the whole order), which does not divide among this loader's ", shards,
                      " processes: resume from a state saved at a step whose batches they share evenly");
    position = whole / shards;
  }
  L.iteration = state.epoch;
  L.resume_position = position > 0 ? std::optional<int64_t>(position) : std::nullopt;
  L.in_pass = false;
  L.end_of_dataloader = false;
  L.last_pass_finished = state.iterator_finished;
}

// ---- DataLoaderState as JSON ----------------------------------------------------------------

std::string DataLoaderState::to_json() const {
  nlohmann::json j = {{"epoch", epoch},
                      {"batches_yielded", batches_yielded},
                      {"iterator_finished", iterator_finished},
                      {"generator_state", generator_state},
                      {"num_processes", num_processes}};
  return j.dump();
}

DataLoaderState DataLoaderState::from_json(const std::string& text) {
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(text);
  } catch (const nlohmann::json::parse_error& e) {
    C10_THROW_ERROR(ValueError, c10::str("[DataLoaderState::from_json] expected a JSON object, got text that does not parse: ", e.what()));
  }
  TORCH_CHECK_VALUE(j.is_object(), "[DataLoaderState::from_json] expected a JSON object, got ", j.type_name());
  auto integer = [&](const char* key) {
    TORCH_CHECK_VALUE(j.contains(key), "[DataLoaderState::from_json] expected the key \"", key, "\", it is missing");
    const auto& v = j.at(key);
    TORCH_CHECK_VALUE(v.is_number_integer() && v.get<int64_t>() >= 0, "[DataLoaderState::from_json] expected \"", key,
                      "\" to be an integer >= 0, got ", v.dump());
    return v.get<int64_t>();
  };
  DataLoaderState state;
  state.epoch = integer("epoch");
  state.batches_yielded = integer("batches_yielded");
  TORCH_CHECK_VALUE(j.contains("iterator_finished") && j.at("iterator_finished").is_boolean(),
                    "[DataLoaderState::from_json] expected \"iterator_finished\" to be true or false, got ",
                    j.contains("iterator_finished") ? j.at("iterator_finished").dump() : std::string("nothing"));
  state.iterator_finished = j.at("iterator_finished").get<bool>();
  TORCH_CHECK_VALUE(j.contains("generator_state") && j.at("generator_state").is_string(),
                    "[DataLoaderState::from_json] expected \"generator_state\" to be a string, got ",
                    j.contains("generator_state") ? j.at("generator_state").dump() : std::string("nothing"));
  state.generator_state = j.at("generator_state").get<std::string>();
  if (j.contains("num_processes")) state.num_processes = integer("num_processes");
  TORCH_CHECK_VALUE(
      detail::data::is_hex(state.generator_state),
      "[DataLoaderState::from_json] expected \"generator_state\" to be an even number of hex digits, got ",
      state.generator_state.size(), " characters that are not");
  return state;
}

}  // namespace accelerate
