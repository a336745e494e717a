// A public header for tests/porting/check_refusal.cmake: each kind of public name once, and
// declarations that are no public name (in comments, strings, detail namespaces, private parts).
#pragma once

#include <string>

namespace accelerate {

namespace detail {
struct Hidden;
void hidden_helper();
}  // namespace detail

namespace state_detail {
inline int also_hidden() { return 1; }
}  // namespace state_detail

namespace {
int anonymous_helper();
}  // namespace

// void commented_out();
/* struct CommentedOut {}; */
inline constexpr const char* kText = "void in_a_string(); struct InAString {};";
inline constexpr char kQuote = '"';

class Accelerator;  // defined below: not a name of its own

template <typename T>
struct TensorTree;  // never defined: a name

template <>
struct TensorTree<int> {};  // a specialisation: no name

enum class Mode { kA, kB };
using ModeList = std::basic_string<char>;
template <typename T>
concept Named = requires(const T& t) { t.name(); };

struct Options {
  int steps = 1;
  std::string (*make)() = nullptr;
};

void overloaded(int x);
void overloaded(const std::string& text, Options options = {});
template <typename F>
auto with_lambda(F f, int n = [] { return 2; }()) {
  return f(n);
}
inline const auto kLambda = [](int x) { return x + 1; };

class Accelerator {
 public:
  explicit Accelerator(const Options& options = {});
  ~Accelerator();
  Accelerator& operator=(const Accelerator&) = delete;
  int step() const { return step_; }
  template <typename M>
  M prepare(M m) const {
    return m;
  }

 private:
  void hidden_member();
  int step_ = 0;

 public:
  void missing_member() const;
};

void missing_function();

}  // namespace accelerate

namespace torch::optim {
class Optimizer;
}  // namespace torch::optim
