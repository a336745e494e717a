// Python's pickle format as data, without LibTorch: reading a pickle into a tree of values and
// writing such a tree back. Nothing a pickle names is imported or called: a global is kept as its
// name, a call (REDUCE, NEWOBJ) as the callable, its arguments and what was set on its result
// (BUILD, SETITEMS, APPENDS), for the caller to interpret against a list of what it accepts.
// Depends only on the standard library, so the fuzz target (fuzz/) builds it alone.
// Rejections are std::invalid_argument naming the offset and the broken rule.
// See Note [Reading pickles] in pickle.cpp.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace accelerate::detail::pickle {

/// One value of a pickle. Values are owned by their `Tree` and point at each other (a pickle may
/// share a value between places, or make one contain itself: walks bound their depth).
struct Value {
  enum class Kind {
    kNone,
    kBool,
    kInt,
    kFloat,
    kString,      ///< str
    kBytes,       ///< bytes, bytearray, Python 2's str
    kList,
    kTuple,
    kDict,
    kSet,         ///< set, frozenset
    kGlobal,      ///< a name (`text` is the module, `name` the name), never imported
    kCall,        ///< `callable(*args)`, never called, with what was set on its result
    kPersistent,  ///< a persistent id (`items[0]`), which the file's container resolves
  };
  Kind kind = Kind::kNone;
  bool boolean = false;
  int64_t integer = 0;
  double number = 0;
  std::string text;  ///< a string's or bytes' content; a global's module
  std::string name;  ///< a global's name
  std::vector<const Value*> items;                            ///< elements; items appended to a call's result
  std::vector<std::pair<const Value*, const Value*>> entries;  ///< dict entries; items set on a call's result
  const Value* callable = nullptr;  ///< kCall: the global called
  const Value* args = nullptr;      ///< kCall: the tuple of arguments
  const Value* state = nullptr;     ///< kCall: BUILD's argument (null: none)

  /// "module.name" of a global.
  std::string qualified_name() const { return text + "." + name; }
};

/// The values of one pickle, and the one it holds.
class Tree {
 public:
  Tree() = default;
  Tree(Tree&&) = default;
  Tree& operator=(Tree&&) = default;

  /// A new value owned by this tree.
  Value* add(Value value);
  Value* add(Value::Kind kind);
  const Value* none();
  const Value* boolean(bool value);
  const Value* integer(int64_t value);
  const Value* number(double value);
  const Value* string(std::string value);
  const Value* list(std::vector<const Value*> items);
  const Value* tuple(std::vector<const Value*> items);
  const Value* dict(std::vector<std::pair<const Value*, const Value*>> entries);
  const Value* global(std::string module, std::string name);
  const Value* call(const Value* callable, const Value* args);
  const Value* persistent(const Value* id);

  /// The pickle's value.
  const Value* root = nullptr;
  /// How many values the tree owns.
  size_t size() const { return values_.size(); }

 private:
  std::vector<std::unique_ptr<Value>> values_;
};

/// How deep `write` and `same` follow values, and the interpreters of pickles should.
inline constexpr int kMaxDepth = 100;

/// The largest pickle `read` accepts, in bytes.
inline constexpr size_t kMaxPickleSize = size_t{1} << 31;

/// Reads the pickle in `data` (protocols 0 to 5, without out-of-band buffers). Refuses a
/// truncated or malformed pickle, an integer beyond 64 bits, a memo reference to nothing, and
/// anything after STOP.
Tree read(std::string_view data);

/// `value` as a protocol 2 pickle (what torch.save writes). Refuses bytes and sets, which
/// protocol 2 writes as calls, and values nested deeper than kMaxDepth (one that contains itself).
std::string write(const Value& value);

/// How many values a walk of `value` visits (a value shared by several places counts at each, a
/// value deeper than kMaxDepth counts once), stopping at `limit`. A pickle of a few bytes can
/// share values into a walk of 2^kMaxDepth: interpreters check this first.
size_t expanded_size(const Value& value, size_t limit);

/// How many values `write` expands at most.
inline constexpr size_t kMaxWrittenValues = size_t{1} << 26;

/// Whether `a` and `b` hold the same tree (a call's parts included). Floats compare by their
/// bits, so NaN equals itself. Raises when either is nested deeper than kMaxDepth.
bool same(const Value& a, const Value& b);

}  // namespace accelerate::detail::pickle
