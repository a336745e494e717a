// The one way the library calls a custom autograd function: `apply_function<F>(args...)` in place
// of `F::apply(args...)` for any `torch::autograd::Function<F>`, so that a compiler warning
// LibTorch's `Function<T>::apply` template raises is silenced once, here, for every autograd
// function present and future (Note [GCC 14 and autograd::Function::apply]). It changes nothing
// else: the call is LibTorch's, with the same arguments and result.
#pragma once

#include <torch/csrc/autograd/custom_function.h>

#include <utility>

namespace accelerate::detail {

// Note [GCC 14 and autograd::Function::apply]
// GCC 14's release builds (-O2/-O3, Debian 13 with LibTorch 2.6) report -Warray-bounds ("forming
// offset 8 is out of the bounds [0, 8]") and -Wstringop-overflow ("writing between 9 and ...
// bytes into a region of size 8") in std::vector<bool>::reserve, which LibTorch's
// Function<T>::apply calls for its inputs: GCC's known false positive on vector<bool>'s word
// copy. GCC 12 and 16 see nothing, and the sanitizer runs of these paths find no access out of
// bounds. A pragma takes effect where the warning's innermost frame under it lies in its region,
// and GCC often keeps Function<T>::apply out of line, in LibTorch's header, out of any region of
// ours: a pragma around each call missed those. So `flatten` inlines LibTorch's apply (and what
// it calls) into this wrapper, whose body lies inside the pragma, and every autograd function of
// the library goes through it.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Warray-bounds"
#pragma GCC diagnostic ignored "-Wstringop-overflow"
#define ACCELERATE_FLATTEN [[gnu::flatten]]
#else
#define ACCELERATE_FLATTEN
#endif

/// Calls `F::apply(args...)`, LibTorch's forward of the autograd function `F`, and returns its
/// result.
template <typename F, typename... Args>
ACCELERATE_FLATTEN auto apply_function(Args&&... args) {
  return F::apply(std::forward<Args>(args)...);
}

#undef ACCELERATE_FLATTEN
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic pop
#endif

}  // namespace accelerate::detail
