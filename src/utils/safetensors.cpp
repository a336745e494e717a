// Reading and writing safetensors files; see include/accelerate/utils/safetensors.h. The format
// rules live in the LibTorch-free formats/safetensors.* (also built by the fuzz target);
// this file maps files, turns byte ranges into tensors and writes files atomically.
#include "accelerate/utils/safetensors.h"

#include "detail/files.h"

#include "formats/safetensors.h"

#include <ATen/Functions.h>
#include <ATen/core/grad_mode.h>
#include <c10/util/Exception.h>

#include <fcntl.h>
#if defined(__x86_64__)
#include <emmintrin.h>
#endif
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <exception>
#include <thread>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <stdexcept>
#include <string_view>
#include <system_error>

namespace accelerate {

namespace format = detail::safetensors_format;

namespace detail {

/// The bytes of one file (mapped copy-on-write, or owned for `from_bytes`) and its validated header.
/// Tensors viewing the bytes hold a shared_ptr to it, so it outlives every view.
struct SafetensorsMapping {
  SafetensorsMapping() = default;
  SafetensorsMapping(const SafetensorsMapping&) = delete;
  SafetensorsMapping& operator=(const SafetensorsMapping&) = delete;
  ~SafetensorsMapping() {
    if (mapped != nullptr) ::munmap(mapped, mapped_length);
  }

  std::string path;
  std::string owned;       // the bytes of an in-memory file
  void* mapped = nullptr;  // the mapping of a file on disk
  size_t mapped_length = 0;
  const char* bytes = nullptr;  // either of the above
  uint64_t size = 0;
  uint64_t data_offset = 0;
  std::map<std::string, SafetensorsEntry> entries;
  SafetensorsMetadata metadata;
};

}  // namespace detail

namespace {

using Mapping = detail::SafetensorsMapping;

struct SafetensorsDtypeName {
  c10::ScalarType dtype;
  const char* name;
};

constexpr SafetensorsDtypeName kDtypeNames[] = {
    {c10::kBool, "BOOL"}, {c10::kByte, "U8"},    {c10::kChar, "I8"},          {c10::kShort, "I16"},
    {c10::kInt, "I32"},   {c10::kLong, "I64"},   {c10::kHalf, "F16"},         {c10::kBFloat16, "BF16"},
    {c10::kFloat, "F32"}, {c10::kDouble, "F64"}, {c10::kComplexFloat, "C64"},
};

const char* name_of(c10::ScalarType dtype) {
  for (const auto& d : kDtypeNames) {
    if (d.dtype == dtype) return d.name;
  }
  return nullptr;
}

std::optional<c10::ScalarType> dtype_of(std::string_view name) {
  for (const auto& d : kDtypeNames) {
    if (d.name == name) return d.dtype;
  }
  return std::nullopt;
}

std::string system_error_text(int error) { return std::generic_category().message(error); }

// Validates the bytes of `mapping` and fills in its header; format errors become ValueErrors
// naming the API and the file.
void index(Mapping& mapping, const char* api) {
  format::Header header;
  try {
    header = format::parse(std::string_view(mapping.bytes, mapping.size));
  } catch (const std::invalid_argument& e) {
    C10_THROW_ERROR(ValueError, c10::str("[", api, "] ", mapping.path, ": ", e.what()));
  }
  for (auto& [name, entry] : header.entries) {
    TORCH_CHECK_VALUE(dtype_of(entry.dtype).has_value(), "[", api, "] ", mapping.path, ": tensor ",
                      format::printable(name), " has dtype ", entry.dtype, ", which LibTorch cannot represent");
    mapping.entries.emplace(name,
                            SafetensorsEntry{std::move(entry.dtype), std::move(entry.shape), entry.begin, entry.end});
  }
  mapping.metadata = std::move(header.metadata);
  mapping.data_offset = header.data_offset();
}

std::shared_ptr<const Mapping> map_file(const std::string& path, const char* api) {
  auto mapping = std::make_shared<Mapping>();
  mapping->path = path;
  // O_NONBLOCK: opening a FIFO must not wait for a writer (it is refused below as not regular).
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK);
  TORCH_CHECK(fd >= 0, "[", api, "] cannot open ", path, ": ", system_error_text(errno));
  struct stat info {};
  const bool stat_ok = ::fstat(fd, &info) == 0;
  const int stat_error = errno;
  if (stat_ok && S_ISREG(info.st_mode) && info.st_size > 0) {
    // Private and writable: a view written into gets its own copy of the page, never the file's.
    void* address = ::mmap(nullptr, static_cast<size_t>(info.st_size), PROT_READ | PROT_WRITE, MAP_PRIVATE, fd, 0);
    const int map_error = errno;
    ::close(fd);
    TORCH_CHECK(address != MAP_FAILED, "[", api, "] cannot map ", path, ": ", system_error_text(map_error));
    mapping->mapped = address;
    mapping->mapped_length = static_cast<size_t>(info.st_size);
    mapping->bytes = static_cast<const char*>(address);
    mapping->size = static_cast<uint64_t>(info.st_size);
  } else {
    ::close(fd);
    TORCH_CHECK(stat_ok, "[", api, "] cannot stat ", path, ": ", system_error_text(stat_error));
    TORCH_CHECK(S_ISREG(info.st_mode), "[", api, "] ", path, " is not a regular file");
    mapping->bytes = "";  // an empty file: the format check rejects it
  }
  index(*mapping, api);
  return mapping;
}

std::shared_ptr<const Mapping> own_bytes(std::string bytes, const char* api) {
  auto mapping = std::make_shared<Mapping>();
  mapping->path = "<memory>";
  mapping->owned = std::move(bytes);
  mapping->bytes = mapping->owned.data();
  mapping->size = mapping->owned.size();
  index(*mapping, api);
  return mapping;
}

// The tensor of `entry`: a view of the bytes when they are aligned for the dtype, else a copy.
at::Tensor make_tensor(const std::shared_ptr<const Mapping>& mapping, const std::string& name,
                       const SafetensorsEntry& entry, const c10::Device& device, const char* api) {
  const c10::ScalarType dtype = *dtype_of(entry.dtype);
  const auto options = at::TensorOptions().dtype(dtype);
  const char* data = mapping->bytes + mapping->data_offset + entry.begin;
  const uint64_t nbytes = entry.end - entry.begin;
  if (dtype == c10::kBool) {
    // A bool byte other than 0 or 1 is undefined behaviour in every kernel that reads it.
    const auto* bytes = reinterpret_cast<const unsigned char*>(data);
    const bool valid = std::all_of(bytes, bytes + nbytes, [](unsigned char b) { return b <= 1; });
    TORCH_CHECK_VALUE(valid, "[", api, "] ", mapping->path, ": BOOL tensor ", format::printable(name),
                      " holds a byte other than 0 and 1");
  }
  at::Tensor tensor;
  if (nbytes == 0) {
    tensor = at::empty(entry.shape, options);
  } else if (reinterpret_cast<uintptr_t>(data) % c10::elementSize(dtype) == 0) {
    // The view's storage owns a reference to the mapping (copy-on-write memory; see the header).
    tensor = at::from_blob(
        const_cast<char*>(data), entry.shape, [keep = mapping](void*) { (void)keep; }, options);
  } else {
    tensor = at::empty(entry.shape, options);
    std::memcpy(tensor.data_ptr(), data, nbytes);
  }
  if (!device.is_cpu()) tensor = tensor.to(device);
  return tensor;
}

// Note [Bulk reads]
// Loading weights into tensors that exist (or owned copies) is a copy out of the page cache into
// memory that is not in any cache: the mapping's pages must be mapped, the source is read once,
// the destination written once. Three things brought it from ~0.6 to ~0.9 of `dd`'s read rate on
// this project's machines (200 MB, warm page cache):
// - each piece's pages are mapped in one call (MADV_POPULATE_READ) instead of one fault per
//   64 KiB; older kernels refuse the advice and fault as before;
// - the destination is written with non-temporal stores, which skip reading every destination
//   line into the cache first (a third of the memory traffic of a plain copy);
// - pieces of 4 MiB are shared by up to four threads when a batch holds more than 8 MiB: one core
//   cannot saturate the memory bus.
// pread would avoid the mapping but copies 30% slower whenever the file offset and the
// destination disagree modulo 64 bytes, which the format's 8-byte alignment makes the rule.

// Copies `n` bytes from `src` to `dst`; large copies bypass the cache (Note [Bulk reads]).
void copy_bypassing_cache(char* dst, const char* src, size_t n) {
#if defined(__x86_64__)
  constexpr size_t kMinimum = 64 * 1024;
  if (n >= kMinimum) {
    const size_t head = (16 - (reinterpret_cast<uintptr_t>(dst) & 15)) & 15;
    std::memcpy(dst, src, head);
    dst += head, src += head, n -= head;
    size_t i = 0;
    for (; i + 64 <= n; i += 64) {
      const __m128i a = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i));
      const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i + 16));
      const __m128i c = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i + 32));
      const __m128i d = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i + 48));
      _mm_stream_si128(reinterpret_cast<__m128i*>(dst + i), a);
      _mm_stream_si128(reinterpret_cast<__m128i*>(dst + i + 16), b);
      _mm_stream_si128(reinterpret_cast<__m128i*>(dst + i + 32), c);
      _mm_stream_si128(reinterpret_cast<__m128i*>(dst + i + 48), d);
    }
    std::memcpy(dst + i, src + i, n - i);
    _mm_sfence();
    return;
  }
#endif
  std::memcpy(dst, src, n);
}

#ifndef MADV_POPULATE_READ
#define MADV_POPULATE_READ 22  // Linux 5.14
#endif

// One contiguous byte range of a file to copy into memory.
struct CopyJob {
  char* destination;
  const char* source;
  size_t size;
};

// Runs `jobs` (Note [Bulk reads]); the mapping behind the sources must outlive the call.
void run_copies(const Mapping& mapping, std::vector<CopyJob> jobs) {
  constexpr size_t kPiece = size_t{4} << 20;
  std::vector<CopyJob> pieces;
  size_t total = 0;
  for (const auto& job : jobs) {
    total += job.size;
    for (size_t at = 0; at < job.size; at += kPiece) {
      pieces.push_back({job.destination + at, job.source + at, std::min(kPiece, job.size - at)});
    }
  }
  const bool mapped = mapping.mapped != nullptr;
  const auto page = static_cast<uintptr_t>(::sysconf(_SC_PAGESIZE));
  const auto copy = [&](const CopyJob& piece) {
    if (mapped) {
      const auto first = reinterpret_cast<uintptr_t>(piece.source) & ~(page - 1);
      const auto last = reinterpret_cast<uintptr_t>(piece.source) + piece.size;
      (void)::madvise(reinterpret_cast<void*>(first), last - first, MADV_POPULATE_READ);
    }
    copy_bypassing_cache(piece.destination, piece.source, piece.size);
  };
  const size_t hardware = std::max(1u, std::thread::hardware_concurrency());
  const size_t threads = std::min({hardware, size_t{4}, pieces.size(), total / (size_t{8} << 20) + 1});
  if (threads <= 1) {
    for (const auto& piece : pieces) copy(piece);
    return;
  }
  std::atomic<size_t> next{0};
  const auto work = [&] {
    for (size_t i = next++; i < pieces.size(); i = next++) copy(pieces[i]);
  };
  std::vector<std::thread> helpers;
  helpers.reserve(threads - 1);
  for (size_t t = 1; t < threads; ++t) helpers.emplace_back(work);
  work();
  for (auto& helper : helpers) helper.join();
}

// The bytes of `entry` in `mapping`.
const char* data_of(const Mapping& mapping, const SafetensorsEntry& entry) {
  return mapping.bytes + mapping.data_offset + entry.begin;
}

// Tensors checked and laid out for writing, in file order.
struct Prepared {
  format::Layout layout;
  std::vector<at::Tensor> tensors;  // in the order of `layout.order`
};

Prepared prepare(const TensorMap& tensors, const SafetensorsMetadata& metadata, const char* api) {
  std::vector<format::TensorSpec> specs;
  std::vector<const at::Tensor*> sources;
  specs.reserve(tensors.size());
  for (const auto& [name, tensor] : tensors) {
    const auto shown = format::printable(name);
    TORCH_CHECK_VALUE(tensor.defined(), "[", api, "] tensor ", shown, " is undefined");
    TORCH_CHECK_VALUE(!tensor.is_quantized(), "[", api, "] tensor ", shown, " is quantized (dtype ",
                      tensor.scalar_type(), "), which the safetensors format cannot store");
    TORCH_CHECK_VALUE(tensor.layout() == c10::kStrided, "[", api, "] tensor ", shown, " has layout ", tensor.layout(),
                      "; only dense tensors can be saved");
    TORCH_CHECK_VALUE(!tensor.is_meta(), "[", api, "] tensor ", shown, " is on the meta device and has no data");
    const char* dtype = name_of(tensor.scalar_type());
    TORCH_CHECK_VALUE(dtype != nullptr, "[", api, "] tensor ", shown, " has dtype ", tensor.scalar_type(),
                      ", which the safetensors format cannot store");
    specs.push_back({name, dtype, tensor.sizes().vec(), static_cast<uint64_t>(tensor.numel()) * tensor.element_size()});
    sources.push_back(&tensor);
  }
  Prepared prepared;
  try {
    prepared.layout = format::plan(specs, metadata);
  } catch (const std::invalid_argument& e) {
    C10_THROW_ERROR(ValueError, c10::str("[", api, "] ", e.what()));
  }
  prepared.tensors.reserve(specs.size());
  for (size_t index : prepared.layout.order) prepared.tensors.push_back(*sources[index]);
  return prepared;
}

// The dense little-endian bytes of `tensor` (a contiguous CPU tensor with conjugation and
// negation resolved; the tensor itself when it already is one).
at::Tensor dense_cpu(const at::Tensor& tensor) {
  return tensor.detach().to(c10::kCPU).resolve_conj().resolve_neg().contiguous();
}


}  // namespace

std::string safetensors_dtype_name(c10::ScalarType dtype) {
  const char* name = name_of(dtype);
  TORCH_CHECK_VALUE(name != nullptr, "[safetensors_dtype_name] the safetensors format has no name for dtype ", dtype);
  return name;
}

c10::ScalarType safetensors_dtype(const std::string& name) {
  if (auto dtype = dtype_of(name)) return *dtype;
  TORCH_CHECK_VALUE(format::find_dtype(name) == nullptr,
                    "[safetensors_dtype] LibTorch cannot represent safetensors dtype ", name);
  C10_THROW_ERROR(ValueError, c10::str("[safetensors_dtype] ", format::printable(name), " is not a safetensors dtype"));
}

std::string save(const TensorMap& tensors, const SafetensorsMetadata& metadata) {
  Prepared prepared = prepare(tensors, metadata, "save");
  std::string bytes;
  bytes.reserve(prepared.layout.prefix.size() + prepared.layout.data_size);
  bytes += prepared.layout.prefix;
  for (const auto& tensor : prepared.tensors) {
    const at::Tensor dense = dense_cpu(tensor);
    bytes.append(static_cast<const char*>(dense.data_ptr()), dense.nbytes());
  }
  return bytes;
}

void save_file(const TensorMap& tensors, const std::string& path, const SafetensorsMetadata& metadata, bool fsync) {
  Prepared prepared = prepare(tensors, metadata, "save_file");
  // Tensors are written one after the other, never assembled in memory (see Note [Atomic write]):
  // at most one run of 8 MiB of them is held (Note [Aligned runs]).
  try {
    detail::write_file_atomically(
        path,
        [&](detail::SequentialWriter& writer) {
          writer.write(prepared.layout.prefix.data(), prepared.layout.prefix.size());
          for (const auto& tensor : prepared.tensors) {
            const at::Tensor dense = dense_cpu(tensor);
            // Held until written (Note [Aligned runs]): a copy made for a GPU or strided tensor
            // would otherwise be freed first.
            writer.write(static_cast<const char*>(dense.data_ptr()), dense.nbytes(),
                         std::make_shared<const at::Tensor>(dense));
          }
        },
        fsync);
  } catch (const c10::Error& e) {
    C10_THROW_ERROR(Error, std::string("[save_file] ") + e.what_without_backtrace());
  }
}

TensorMap load(const std::string& bytes) {
  const auto mapping = own_bytes(bytes, "load");
  TensorMap tensors;
  for (const auto& [name, entry] : mapping->entries)
    tensors.emplace(name, make_tensor(mapping, name, entry, c10::kCPU, "load"));
  return tensors;
}

TensorMap load_file(const std::string& path, const c10::Device& device) {
  const auto mapping = map_file(path, "load_file");
  TensorMap tensors;
  for (const auto& [name, entry] : mapping->entries)
    tensors.emplace(name, make_tensor(mapping, name, entry, device, "load_file"));
  return tensors;
}

SafetensorsFile::SafetensorsFile(const std::string& path) : mapping_(map_file(path, "SafetensorsFile")) {}

SafetensorsFile::SafetensorsFile(std::shared_ptr<const detail::SafetensorsMapping> mapping)
    : mapping_(std::move(mapping)) {}

SafetensorsFile SafetensorsFile::from_bytes(std::string bytes) {
  return SafetensorsFile(own_bytes(std::move(bytes), "SafetensorsFile::from_bytes"));
}

std::vector<std::string> SafetensorsFile::keys() const {
  std::vector<std::string> names;
  names.reserve(mapping_->entries.size());
  for (const auto& [name, entry] : mapping_->entries) names.push_back(name);
  return names;
}

bool SafetensorsFile::contains(const std::string& name) const { return mapping_->entries.count(name) > 0; }

const SafetensorsMetadata& SafetensorsFile::metadata() const { return mapping_->metadata; }

const SafetensorsEntry& SafetensorsFile::entry(const std::string& name) const {
  const auto found = mapping_->entries.find(name);
  TORCH_CHECK_VALUE(found != mapping_->entries.end(), "[SafetensorsFile::entry] no tensor named ",
                    format::printable(name), " in ", mapping_->path);
  return found->second;
}

at::Tensor SafetensorsFile::get_tensor(const std::string& name, const c10::Device& device) const {
  const auto found = mapping_->entries.find(name);
  TORCH_CHECK_VALUE(found != mapping_->entries.end(), "[SafetensorsFile::get_tensor] no tensor named ",
                    format::printable(name), " in ", mapping_->path);
  return make_tensor(mapping_, name, found->second, device, "SafetensorsFile::get_tensor");
}

TensorMap SafetensorsFile::read_tensors(const std::vector<std::string>& names, const c10::Device& device) const {
  const char* api = "SafetensorsFile::read_tensors";
  std::vector<std::pair<const std::string*, const SafetensorsEntry*>> wanted;
  if (names.empty()) {
    for (const auto& [name, entry] : mapping_->entries) wanted.emplace_back(&name, &entry);
  } else {
    for (const auto& name : names) {
      const auto found = mapping_->entries.find(name);
      TORCH_CHECK_VALUE(found != mapping_->entries.end(), "[", api, "] no tensor named ", format::printable(name),
                        " in ", mapping_->path);
      wanted.emplace_back(&found->first, &found->second);
    }
  }
  TensorMap out;
  std::vector<CopyJob> jobs;
  for (const auto& [name, entry] : wanted) {
    const c10::ScalarType dtype = *dtype_of(entry->dtype);
    if (dtype == c10::kBool || entry->end == entry->begin) {
      // Checked byte by byte (or nothing to copy): the general path.
      out.insert_or_assign(*name, make_tensor(mapping_, *name, *entry, c10::kCPU, api).clone());
      continue;
    }
    auto tensor = at::empty(entry->shape, at::TensorOptions().dtype(dtype));
    jobs.push_back({static_cast<char*>(tensor.data_ptr()), data_of(*mapping_, *entry), entry->end - entry->begin});
    out.insert_or_assign(*name, std::move(tensor));
  }
  run_copies(*mapping_, std::move(jobs));
  if (!device.is_cpu()) {
    for (auto& [name, tensor] : out) tensor = tensor.to(device);
  }
  return out;
}

void SafetensorsFile::read_into(const TensorMap& targets) const {
  const char* api = "SafetensorsFile::read_into";
  // Every name and shape is checked before the first byte is written.
  for (const auto& [name, target] : targets) {
    const auto found = mapping_->entries.find(name);
    TORCH_CHECK_VALUE(found != mapping_->entries.end(), "[", api, "] no tensor named ", format::printable(name),
                      " in ", mapping_->path);
    TORCH_CHECK_VALUE(target.defined(), "[", api, "] the target of ", format::printable(name), " is undefined");
    TORCH_CHECK_VALUE(target.sizes() == at::IntArrayRef(found->second.shape), "[", api, "] size mismatch for ",
                      format::printable(name), ": ", mapping_->path, " has shape ", at::IntArrayRef(found->second.shape),
                      ", the target has shape ", target.sizes());
    TORCH_CHECK_VALUE(!target.is_meta(), "[", api, "] the target of ", format::printable(name),
                      " is on the meta device and has no memory to read into");
  }
  std::vector<CopyJob> jobs;
  std::vector<at::Tensor> direct;
  std::vector<std::pair<at::Tensor, at::Tensor>> converted;  // (target, source)
  for (const auto& [name, target] : targets) {
    const auto& entry = mapping_->entries.at(name);
    const c10::ScalarType dtype = *dtype_of(entry.dtype);
    if (target.device().is_cpu() && target.scalar_type() == dtype && dtype != c10::kBool &&
        target.is_non_overlapping_and_dense() && target.is_contiguous() && !target.is_conj() && !target.is_neg() &&
        entry.end > entry.begin) {
      jobs.push_back({static_cast<char*>(target.data_ptr()), data_of(*mapping_, entry), entry.end - entry.begin});
      direct.push_back(target);
    } else {
      // Made (and, for BOOL, checked) before anything is written.
      converted.emplace_back(target, make_tensor(mapping_, name, entry, c10::kCPU, api));
    }
  }
  run_copies(*mapping_, std::move(jobs));
  // Written behind autograd's back: a graph that saved one of these tensors must notice.
  for (auto& t : direct) t.unsafeGetTensorImpl()->bump_version();
  at::NoGradGuard no_grad;
  for (auto& [target, source] : converted) target.copy_(source);
}

uint64_t SafetensorsFile::file_size() const { return mapping_->size; }

const std::string& SafetensorsFile::path() const { return mapping_->path; }

}  // namespace accelerate
