// Python's pickle format as data (see pickle.h).
#include "formats/pickle.h"

#include <bit>
#include <cstring>
#include <stdexcept>
#include <unordered_map>

namespace accelerate::detail::pickle {

Value* Tree::add(Value value) {
  values_.push_back(std::make_unique<Value>(std::move(value)));
  return values_.back().get();
}

Value* Tree::add(Value::Kind kind) {
  Value v;
  v.kind = kind;
  return add(std::move(v));
}

const Value* Tree::none() { return add(Value::Kind::kNone); }

const Value* Tree::boolean(bool value) {
  auto* v = add(Value::Kind::kBool);
  v->boolean = value;
  return v;
}

const Value* Tree::integer(int64_t value) {
  auto* v = add(Value::Kind::kInt);
  v->integer = value;
  return v;
}

const Value* Tree::number(double value) {
  auto* v = add(Value::Kind::kFloat);
  v->number = value;
  return v;
}

const Value* Tree::string(std::string value) {
  auto* v = add(Value::Kind::kString);
  v->text = std::move(value);
  return v;
}

const Value* Tree::list(std::vector<const Value*> items) {
  auto* v = add(Value::Kind::kList);
  v->items = std::move(items);
  return v;
}

const Value* Tree::tuple(std::vector<const Value*> items) {
  auto* v = add(Value::Kind::kTuple);
  v->items = std::move(items);
  return v;
}

const Value* Tree::dict(std::vector<std::pair<const Value*, const Value*>> entries) {
  auto* v = add(Value::Kind::kDict);
  v->entries = std::move(entries);
  return v;
}

const Value* Tree::global(std::string module, std::string name) {
  auto* v = add(Value::Kind::kGlobal);
  v->text = std::move(module);
  v->name = std::move(name);
  return v;
}

const Value* Tree::call(const Value* callable, const Value* args) {
  auto* v = add(Value::Kind::kCall);
  v->callable = callable;
  v->args = args;
  return v;
}

const Value* Tree::persistent(const Value* id) {
  auto* v = add(Value::Kind::kPersistent);
  v->items = {id};
  return v;
}

namespace {

// Note [Reading pickles]
// The reader runs the pickle machine's stack and memo but calls nothing: GLOBAL and STACK_GLOBAL
// push a name, REDUCE, NEWOBJ and NEWOBJ_EX push a call node, BUILD records its argument on the
// call, SETITEM(S) and APPEND(S) on a call record their items on it (PyTorch's OrderedDicts are
// built that way). What a call means is for the caller to decide, against what it accepts. Every
// length is checked against the bytes left before anything is read or reserved, so a pickle costs
// at most a constant times its size in memory. Values live in the Tree's arena and point at each
// other, so a pickle that makes a list contain itself leaks nothing and destroys without
// recursion; whoever walks the values bounds its depth (kMaxDepth). The opcodes of protocol 0
// that need Python's text parsing (FLOAT, STRING, UNICODE, PERSID, INST, OBJ) and the extension
// registry and out-of-band buffers are refused by name.

class Reader {
 public:
  explicit Reader(std::string_view data) : data_(data) {}

  Tree run() {
    if (data_.size() > kMaxPickleSize) fail("the pickle is larger than 2 GiB");
    while (true) {
      if (pos_ >= data_.size()) fail("the pickle ends before its STOP opcode");
      op_at_ = pos_;
      const auto op = static_cast<unsigned char>(data_[pos_++]);
      if (op == '.') break;
      step(op);
    }
    if (stack_.size() != 1 || !marks_.empty()) fail("STOP leaves " + std::to_string(stack_.size()) + " values on the stack");
    if (pos_ != data_.size()) fail("bytes follow the STOP opcode");
    tree_.root = stack_.back();
    return std::move(tree_);
  }

 private:
  [[noreturn]] void fail(const std::string& what) const {
    throw std::invalid_argument("pickle: " + what + " (at byte " + std::to_string(op_at_) + ")");
  }

  std::string_view take(uint64_t n) {
    if (n > data_.size() - pos_) fail("a length of " + std::to_string(n) + " runs past the end of the pickle");
    auto out = data_.substr(pos_, n);
    pos_ += n;
    return out;
  }
  uint64_t unsigned_le(int bytes) {
    const auto b = take(bytes);
    uint64_t v = 0;
    for (int i = bytes - 1; i >= 0; --i) v = (v << 8) | static_cast<unsigned char>(b[i]);
    return v;
  }
  std::string_view line() {
    const auto end = data_.find('\n', pos_);
    if (end == std::string_view::npos) fail("a text argument has no end of line");
    auto out = data_.substr(pos_, end - pos_);
    pos_ = end + 1;
    return out;
  }
  int64_t decimal(std::string_view text) {
    if (text.empty() || text.size() > 20) fail("a text integer is empty or too long");
    size_t i = text[0] == '-' ? 1 : 0;
    if (i == text.size()) fail("a text integer has no digits");
    uint64_t v = 0;
    for (; i < text.size(); ++i) {
      if (text[i] < '0' || text[i] > '9') fail("a text integer holds a non-digit");
      if (v > (uint64_t{1} << 63) / 10) fail("an integer beyond 64 bits");
      v = v * 10 + static_cast<uint64_t>(text[i] - '0');
    }
    const bool negative = text[0] == '-';
    if (v > (uint64_t{1} << 63) - (negative ? 0 : 1)) fail("an integer beyond 64 bits");
    return negative ? static_cast<int64_t>(0 - v) : static_cast<int64_t>(v);
  }
  // A little-endian two's complement integer of `n` bytes (LONG1, LONG4).
  int64_t long_bytes(uint64_t n) {
    const auto b = take(n);
    if (n == 0) return 0;
    if (n > 8) {
      // Bytes beyond the 8th must only extend the sign.
      const unsigned char fill = (static_cast<unsigned char>(b[7]) & 0x80) ? 0xff : 0;
      for (size_t i = 8; i < n; ++i) {
        if (static_cast<unsigned char>(b[i]) != fill) fail("an integer beyond 64 bits");
      }
      n = 8;
    }
    uint64_t v = 0;
    for (int i = static_cast<int>(n) - 1; i >= 0; --i) v = (v << 8) | static_cast<unsigned char>(b[i]);
    if (n < 8 && (static_cast<unsigned char>(b[n - 1]) & 0x80)) v |= ~uint64_t{0} << (8 * n);
    return static_cast<int64_t>(v);
  }

  const Value* pop() {
    if (stack_.empty() || (!marks_.empty() && stack_.size() == marks_.back())) fail("an opcode needs a value the stack lacks");
    const auto* v = stack_.back();
    stack_.pop_back();
    return v;
  }
  Value* pop_mutable() { return const_cast<Value*>(pop()); }  // every value is the tree's
  const Value* top() {
    if (stack_.empty() || (!marks_.empty() && stack_.size() == marks_.back())) fail("an opcode needs a value the stack lacks");
    return stack_.back();
  }
  std::vector<const Value*> pop_mark() {
    if (marks_.empty()) fail("an opcode needs a MARK that is not there");
    const size_t at = marks_.back();
    marks_.pop_back();
    std::vector<const Value*> items(stack_.begin() + static_cast<std::ptrdiff_t>(at), stack_.end());
    stack_.resize(at);
    return items;
  }
  void push(const Value* v) { stack_.push_back(v); }
  void push_string(Value::Kind kind, std::string_view text) {
    auto* v = tree_.add(kind);
    v->text = std::string(text);
    push(v);
  }
  void memo_put(uint64_t index) { memo_[index] = top(); }
  void memo_get(uint64_t index) {
    auto it = memo_.find(index);
    if (it == memo_.end()) fail("a memo reference to entry " + std::to_string(index) + ", which was never stored");
    push(it->second);
  }
  // Items set or appended on the value below them: a dict or list, or a call's result.
  void set_items(std::vector<const Value*> items) {
    if (items.size() % 2 != 0) fail("SETITEMS with an odd number of values");
    auto* target = pop_mutable();
    if (target->kind != Value::Kind::kDict && target->kind != Value::Kind::kCall) fail("SETITEM on a value that is not a dict");
    for (size_t i = 0; i < items.size(); i += 2) target->entries.emplace_back(items[i], items[i + 1]);
    push(target);
  }
  void append_items(std::vector<const Value*> items) {
    auto* target = pop_mutable();
    if (target->kind != Value::Kind::kList && target->kind != Value::Kind::kCall) fail("APPEND on a value that is not a list");
    target->items.insert(target->items.end(), items.begin(), items.end());
    push(target);
  }
  void make_call(const Value* callable, const Value* args) {
    if (callable->kind != Value::Kind::kGlobal) fail("a call of a value that is not a global");
    if (args->kind != Value::Kind::kTuple) fail("a call whose arguments are not a tuple");
    push(tree_.call(callable, args));
  }
  void make_global(std::string module, std::string name) {
    if (module.empty() || name.empty()) fail("a global without a module or a name");
    push(tree_.global(std::move(module), std::move(name)));
  }

  void step(unsigned char op) {
    using K = Value::Kind;
    switch (op) {
      case 0x80: {  // PROTO
        const auto version = unsigned_le(1);
        if (version > 5) fail("protocol " + std::to_string(version) + " is newer than 5");
        return;
      }
      case 0x95:  // FRAME: only a hint of the bytes that follow
        unsigned_le(8);
        return;
      case '(': marks_.push_back(stack_.size()); return;
      case '0': pop(); return;
      case '1': pop_mark(); return;
      case '2': push(top()); return;
      case 'N': push(tree_.none()); return;
      case 0x88: push(tree_.boolean(true)); return;
      case 0x89: push(tree_.boolean(false)); return;
      case 'J': push(tree_.integer(static_cast<int32_t>(static_cast<uint32_t>(unsigned_le(4))))); return;
      case 'K': push(tree_.integer(static_cast<int64_t>(unsigned_le(1)))); return;
      case 'M': push(tree_.integer(static_cast<int64_t>(unsigned_le(2)))); return;
      case 0x8a: push(tree_.integer(long_bytes(unsigned_le(1)))); return;
      case 0x8b: push(tree_.integer(long_bytes(unsigned_le(4)))); return;
      case 'I': {  // INT: "I01\n" and "I00\n" are True and False
        const auto text = line();
        if (text == "01" || text == "00") {
          push(tree_.boolean(text == "01"));
        } else {
          push(tree_.integer(decimal(text)));
        }
        return;
      }
      case 'L': {
        auto text = line();
        if (!text.empty() && text.back() == 'L') text.remove_suffix(1);
        push(tree_.integer(decimal(text)));
        return;
      }
      case 'G': {
        const auto bits = unsigned_le(8);
        push(tree_.number(std::bit_cast<double>(__builtin_bswap64(bits))));
        return;
      }
      case 'X': push_string(K::kString, take(unsigned_le(4))); return;
      case 0x8c: push_string(K::kString, take(unsigned_le(1))); return;
      case 0x8d: push_string(K::kString, take(unsigned_le(8))); return;
      case 'T': push_string(K::kBytes, take(unsigned_le(4))); return;
      case 'U': push_string(K::kBytes, take(unsigned_le(1))); return;
      case 'B': push_string(K::kBytes, take(unsigned_le(4))); return;
      case 'C': push_string(K::kBytes, take(unsigned_le(1))); return;
      case 0x8e: push_string(K::kBytes, take(unsigned_le(8))); return;
      case 0x96: push_string(K::kBytes, take(unsigned_le(8))); return;
      case '}': push(tree_.add(K::kDict)); return;
      case ']': push(tree_.add(K::kList)); return;
      case ')': push(tree_.add(K::kTuple)); return;
      case 0x8f: push(tree_.add(K::kSet)); return;
      case 'd': {
        const auto items = pop_mark();
        if (items.size() % 2 != 0) fail("DICT with an odd number of values");
        auto* d = tree_.add(K::kDict);
        for (size_t i = 0; i < items.size(); i += 2) d->entries.emplace_back(items[i], items[i + 1]);
        push(d);
        return;
      }
      case 'l': push(tree_.list(pop_mark())); return;
      case 't': push(tree_.tuple(pop_mark())); return;
      case 0x91: {
        auto* s = tree_.add(K::kSet);
        s->items = pop_mark();
        push(s);
        return;
      }
      case 0x85: case 0x86: case 0x87: {
        std::vector<const Value*> items(op - 0x84);
        for (auto it = items.rbegin(); it != items.rend(); ++it) *it = pop();
        push(tree_.tuple(std::move(items)));
        return;
      }
      case 'a': {
        const auto* item = pop();
        append_items({item});
        return;
      }
      case 'e': append_items(pop_mark()); return;
      case 's': {
        const auto* value = pop();
        const auto* key = pop();
        set_items({key, value});
        return;
      }
      case 'u': set_items(pop_mark()); return;
      case 0x90: {
        auto items = pop_mark();
        auto* target = pop_mutable();
        if (target->kind != K::kSet) fail("ADDITEMS on a value that is not a set");
        target->items.insert(target->items.end(), items.begin(), items.end());
        push(target);
        return;
      }
      case 'p': memo_put(static_cast<uint64_t>(decimal(line()))); return;
      case 'q': memo_put(unsigned_le(1)); return;
      case 'r': memo_put(unsigned_le(4)); return;
      case 0x94: memo_put(memo_.size()); return;
      case 'g': memo_get(static_cast<uint64_t>(decimal(line()))); return;
      case 'h': memo_get(unsigned_le(1)); return;
      case 'j': memo_get(unsigned_le(4)); return;
      case 'c': {
        std::string module(line());
        std::string name(line());
        make_global(std::move(module), std::move(name));
        return;
      }
      case 0x93: {
        const auto* name = pop();
        const auto* module = pop();
        if (module->kind != K::kString || name->kind != K::kString) fail("STACK_GLOBAL of values that are not strings");
        make_global(module->text, name->text);
        return;
      }
      case 'R': {
        const auto* args = pop();
        const auto* callable = pop();
        make_call(callable, args);
        return;
      }
      case 0x81: {
        const auto* args = pop();
        const auto* cls = pop();
        make_call(cls, args);
        return;
      }
      case 0x92: {  // NEWOBJ_EX: keyword arguments are not read
        const auto* kwargs = pop();
        const auto* args = pop();
        const auto* cls = pop();
        if (kwargs->kind != K::kDict || !kwargs->entries.empty()) fail("NEWOBJ_EX with keyword arguments");
        make_call(cls, args);
        return;
      }
      case 'b': {
        const auto* state = pop();
        auto* target = pop_mutable();
        if (target->kind != K::kCall) fail("BUILD on a value that is not an object");
        if (target->state != nullptr) fail("BUILD twice on one object");
        target->state = state;
        push(target);
        return;
      }
      case 'Q': push(tree_.persistent(pop())); return;
      case 'F': fail("the protocol 0 opcode FLOAT is not read");
      case 'S': fail("the protocol 0 opcode STRING is not read");
      case 'V': fail("the protocol 0 opcode UNICODE is not read");
      case 'P': fail("the protocol 0 opcode PERSID is not read");
      case 'i': fail("the protocol 0 opcode INST is not read");
      case 'o': fail("the protocol 1 opcode OBJ is not read");
      case 0x82: case 0x83: case 0x84: fail("the extension registry (EXT1, EXT2, EXT4) is not read");
      case 0x97: case 0x98: fail("out-of-band buffers (NEXT_BUFFER, READONLY_BUFFER) are not read");
      default: {
        static const char* hex = "0123456789abcdef";
        fail(std::string("unknown opcode 0x") + hex[op >> 4] + hex[op & 15]);
      }
    }
  }

  std::string_view data_;
  size_t pos_ = 0;
  size_t op_at_ = 0;
  Tree tree_;
  std::vector<const Value*> stack_;
  std::vector<size_t> marks_;
  std::unordered_map<uint64_t, const Value*> memo_;
};

// ---- writing -------------------------------------------------------------------------------

class Writer {
 public:
  std::string run(const Value& value) {
    if (expanded_size(value, kMaxWrittenValues) >= kMaxWrittenValues) {
      throw std::invalid_argument("pickle: the value expands to more than 2^26 values");
    }
    out_ += "\x80\x02";
    put(value, 0);
    out_ += '.';
    return std::move(out_);
  }

 private:
  void raw_le(uint64_t v, int bytes) {
    for (int i = 0; i < bytes; ++i) out_ += static_cast<char>((v >> (8 * i)) & 0xff);
  }
  void put_int(int64_t v) {
    if (v >= 0 && v < 256) {
      out_ += 'K';
      raw_le(static_cast<uint64_t>(v), 1);
    } else if (v >= 0 && v < 65536) {
      out_ += 'M';
      raw_le(static_cast<uint64_t>(v), 2);
    } else if (v >= INT32_MIN && v <= INT32_MAX) {
      out_ += 'J';
      raw_le(static_cast<uint32_t>(static_cast<int32_t>(v)), 4);
    } else {
      // The fewest little-endian two's complement bytes that keep the sign.
      int n = 8;
      while (n > 1) {
        const int64_t shifted = v >> (8 * (n - 1) - 1);
        if (shifted != 0 && shifted != -1) break;
        --n;
      }
      out_ += '\x8a';
      out_ += static_cast<char>(n);
      raw_le(static_cast<uint64_t>(v), n);
    }
  }
  void put_text(const std::string& text) {
    if (text.size() > UINT32_MAX) throw std::invalid_argument("pickle: a string longer than 4 GiB");
    out_ += 'X';
    raw_le(text.size(), 4);
    out_ += text;
  }
  void put_tuple(const std::vector<const Value*>& items, int depth) {
    if (items.empty()) {
      out_ += ')';
      return;
    }
    if (items.size() <= 3) {
      for (const auto* item : items) put(*item, depth + 1);
      out_ += static_cast<char>(0x84 + items.size());
      return;
    }
    out_ += '(';
    for (const auto* item : items) put(*item, depth + 1);
    out_ += 't';
  }
  void put_entries(const std::vector<std::pair<const Value*, const Value*>>& entries, int depth) {
    if (entries.empty()) return;
    out_ += '(';
    for (const auto& [k, v] : entries) {
      put(*k, depth + 1);
      put(*v, depth + 1);
    }
    out_ += 'u';
  }
  void put_items(const std::vector<const Value*>& items, int depth) {
    if (items.empty()) return;
    out_ += '(';
    for (const auto* item : items) put(*item, depth + 1);
    out_ += 'e';
  }

  void put(const Value& v, int depth) {
    using K = Value::Kind;
    if (depth > kMaxDepth) throw std::invalid_argument("pickle: values nested deeper than " + std::to_string(kMaxDepth));
    switch (v.kind) {
      case K::kNone: out_ += 'N'; return;
      case K::kBool: out_ += v.boolean ? '\x88' : '\x89'; return;
      case K::kInt: put_int(v.integer); return;
      case K::kFloat:
        out_ += 'G';
        for (int i = 7; i >= 0; --i) out_ += static_cast<char>((std::bit_cast<uint64_t>(v.number) >> (8 * i)) & 0xff);
        return;
      case K::kString: put_text(v.text); return;
      case K::kBytes: throw std::invalid_argument("pickle: protocol 2 writes bytes as a call; bytes are not written");
      case K::kSet: throw std::invalid_argument("pickle: protocol 2 writes sets as a call; sets are not written");
      case K::kList:
        out_ += ']';
        put_items(v.items, depth);
        return;
      case K::kTuple: put_tuple(v.items, depth); return;
      case K::kDict:
        out_ += '}';
        put_entries(v.entries, depth);
        return;
      case K::kGlobal:
        if (v.text.find('\n') != std::string::npos || v.name.find('\n') != std::string::npos) {
          throw std::invalid_argument("pickle: a global's name holds a line break");
        }
        out_ += 'c' + v.text + '\n' + v.name + '\n';
        return;
      case K::kCall:
        if (v.callable == nullptr || v.callable->kind != K::kGlobal || v.args == nullptr || v.args->kind != K::kTuple) {
          throw std::invalid_argument("pickle: a call must be of a global, with a tuple of arguments");
        }
        put(*v.callable, depth + 1);
        put(*v.args, depth + 1);
        out_ += 'R';
        put_items(v.items, depth);
        put_entries(v.entries, depth);
        if (v.state != nullptr) {
          put(*v.state, depth + 1);
          out_ += 'b';
        }
        return;
      case K::kPersistent:
        if (v.items.size() != 1) throw std::invalid_argument("pickle: a persistent id holds one value");
        put(*v.items[0], depth + 1);
        out_ += 'Q';
        return;
    }
  }

  std::string out_;
};

void count(const Value* v, int depth, size_t limit, size_t& n) {
  if (v == nullptr || n >= limit) return;
  ++n;
  if (depth > kMaxDepth) return;
  for (const auto* item : v->items) count(item, depth + 1, limit, n);
  for (const auto& [k, x] : v->entries) {
    count(k, depth + 1, limit, n);
    count(x, depth + 1, limit, n);
  }
  count(v->callable, depth + 1, limit, n);
  count(v->args, depth + 1, limit, n);
  count(v->state, depth + 1, limit, n);
}

bool same_at(const Value* a, const Value* b, int depth) {
  if (a == nullptr || b == nullptr) return a == b;
  if (depth > kMaxDepth) throw std::invalid_argument("pickle: values nested deeper than " + std::to_string(kMaxDepth));
  if (a->kind != b->kind || a->boolean != b->boolean || a->integer != b->integer ||
      std::bit_cast<uint64_t>(a->number) != std::bit_cast<uint64_t>(b->number) || a->text != b->text ||
      a->name != b->name || a->items.size() != b->items.size() || a->entries.size() != b->entries.size()) {
    return false;
  }
  for (size_t i = 0; i < a->items.size(); ++i) {
    if (!same_at(a->items[i], b->items[i], depth + 1)) return false;
  }
  for (size_t i = 0; i < a->entries.size(); ++i) {
    if (!same_at(a->entries[i].first, b->entries[i].first, depth + 1) ||
        !same_at(a->entries[i].second, b->entries[i].second, depth + 1)) {
      return false;
    }
  }
  return same_at(a->callable, b->callable, depth + 1) && same_at(a->args, b->args, depth + 1) &&
         same_at(a->state, b->state, depth + 1);
}

}  // namespace

size_t expanded_size(const Value& value, size_t limit) {
  size_t n = 0;
  count(&value, 0, limit, n);
  return n;
}

Tree read(std::string_view data) { return Reader(data).run(); }

std::string write(const Value& value) { return Writer().run(value); }

bool same(const Value& a, const Value& b) { return same_at(&a, &b, 0); }

}  // namespace accelerate::detail::pickle
