// libFuzzer target for the metadata reader of torch.distributed.checkpoint folders
// (src/formats/dcp.*), what load_state and merge-weights read first of upstream's FSDP folders:
// any input must either be refused with std::invalid_argument or be read; what is read must pass
// or fail the check of its items against the folder's files (offsets and lengths within each
// file) with std::invalid_argument only, and must be written and read back to the same metadata.
// Any other exception, sanitizer report, leak or broken invariant is a crash.
#include "formats/dcp.h"

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <stdexcept>
#include <string>
#include <string_view>

namespace dcp = accelerate::detail::dcp;

namespace {

void require(bool condition, const char* what) {
  if (!condition) {
    std::fprintf(stderr, "invariant broken: %s\n", what);
    std::abort();
  }
}

bool same(const dcp::Location& a, const dcp::Location& b) {
  return a.file == b.file && a.offset == b.offset && a.length == b.length;
}

bool same(const dcp::Metadata& a, const dcp::Metadata& b) {
  if (a.tensors.size() != b.tensors.size() || a.values.size() != b.values.size() || a.paths != b.paths) return false;
  for (const auto& [key, entry] : a.tensors) {
    auto it = b.tensors.find(key);
    if (it == b.tensors.end() || it->second.dtype != entry.dtype || it->second.size != entry.size ||
        it->second.chunks.size() != entry.chunks.size()) {
      return false;
    }
    for (size_t i = 0; i < entry.chunks.size(); ++i) {
      const auto& x = entry.chunks[i];
      const auto& y = it->second.chunks[i];
      if (x.offsets != y.offsets || x.sizes != y.sizes || !same(x.where, y.where)) return false;
    }
  }
  for (const auto& [key, where] : a.values) {
    auto it = b.values.find(key);
    if (it == b.values.end() || !same(it->second, where)) return false;
  }
  return true;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string_view input(reinterpret_cast<const char*>(data), size);
  dcp::Metadata metadata;
  try {
    metadata = dcp::read_metadata(input);
  } catch (const std::invalid_argument&) {
    return 0;
  }
  // The files of a folder saved by four processes, of a few sizes.
  try {
    dcp::check_locations(metadata, {{dcp::data_file(0), 20000}, {dcp::data_file(1), 20000},
                                    {dcp::data_file(2), 6180}, {dcp::data_file(3), size}});
  } catch (const std::invalid_argument&) {
  }
  std::string written;
  try {
    written = dcp::write_metadata(metadata);
  } catch (const std::invalid_argument&) {
    return 0;  // a key nested deeper than the pickle writer's bound
  }
  dcp::Metadata again;
  try {
    again = dcp::read_metadata(written);
  } catch (const std::invalid_argument& e) {
    std::fprintf(stderr, "the written metadata is refused: %s\n", e.what());
    require(false, "the written metadata reads back");
  }
  require(same(metadata, again), "the written metadata reads back to the same");
  return 0;
}
