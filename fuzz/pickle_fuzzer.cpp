// libFuzzer target for the pickle reader (src/formats/pickle.*), the first step of reading any
// file torch.save wrote: any input must either be rejected with std::invalid_argument or be read
// into a tree; a tree that protocol 2 can hold (no bytes, no sets) and that expands to few values
// must be written, read back to the same tree, and written again to the same bytes. Any other
// exception, sanitizer report, leak or broken invariant is a crash.
#include "formats/pickle.h"

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <stdexcept>
#include <string>
#include <string_view>

namespace pickle = accelerate::detail::pickle;

namespace {

void require(bool condition, const char* what) {
  if (!condition) {
    std::fprintf(stderr, "invariant broken: %s\n", what);
    std::abort();
  }
}

// Whether `write` takes the tree: no bytes or sets, calls of globals with tuples of arguments.
bool writable(const pickle::Value* v, int depth) {
  using K = pickle::Value::Kind;
  if (v == nullptr) return true;
  if (depth > pickle::kMaxDepth || v->kind == K::kBytes || v->kind == K::kSet) return false;
  if (v->kind == K::kGlobal && (v->text.find('\n') != std::string::npos || v->name.find('\n') != std::string::npos)) {
    return false;
  }
  if (v->kind == K::kString && v->text.size() > UINT32_MAX) return false;
  for (const auto* item : v->items) {
    if (!writable(item, depth + 1)) return false;
  }
  for (const auto& [k, x] : v->entries) {
    if (!writable(k, depth + 1) || !writable(x, depth + 1)) return false;
  }
  return writable(v->callable, depth + 1) && writable(v->args, depth + 1) && writable(v->state, depth + 1);
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string_view input(reinterpret_cast<const char*>(data), size);
  pickle::Tree tree;
  try {
    tree = pickle::read(input);
  } catch (const std::invalid_argument&) {
    return 0;
  }
  require(tree.root != nullptr, "an accepted pickle has a value");
  require(tree.size() <= 4 * size + 16, "a pickle's values are bounded by its size");
  constexpr size_t kLimit = 20000;
  if (pickle::expanded_size(*tree.root, kLimit) >= kLimit || !writable(tree.root, 0)) return 0;
  std::string written;
  try {
    written = pickle::write(*tree.root);
  } catch (const std::invalid_argument&) {
    return 0;  // nested deeper than the writer follows
  }
  const auto again = pickle::read(written);
  require(pickle::same(*tree.root, *again.root), "a written tree reads back the same");
  require(pickle::write(*again.root) == written, "writing is stable");
  return 0;
}
