// dist::Agreement (agreement.h): every rank's failure and fields in one exchange, an error on every rank.
#include "gpuops/agreement.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <random>

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <fmt/format.h>

#include "../memory/memory_scope.h"

namespace gpuops::dist {
namespace {

// Bounds that keep the exchange small whatever a caller passes: a longer value travels as its fingerprint.
constexpr size_t kMaxError = 2000;
constexpr size_t kMaxValue = 1000;

struct Decoded {
  std::string error;
  struct Field {
    std::string name, value;
    bool compared;
  };
  std::vector<Field> fields;
};

void put(std::string& out, const std::string& s) {
  const auto n = static_cast<uint32_t>(s.size());
  out.append(reinterpret_cast<const char*>(&n), sizeof n);
  out.append(s);
}

// Reads what put() wrote; false when the bytes end early (a peer of another gpuops version).
bool get(const char*& p, const char* end, std::string& s) {
  uint32_t n = 0;
  if (end - p < static_cast<ptrdiff_t>(sizeof n)) return false;
  std::memcpy(&n, p, sizeof n);
  p += sizeof n;
  if (end - p < static_cast<ptrdiff_t>(n)) return false;
  s.assign(p, n);
  p += n;
  return true;
}

std::string bounded(const std::string& value) {
  if (value.size() <= kMaxValue) return value;
  return fmt::format("{}... ({} bytes, fingerprint {})", value.substr(0, 80), value.size(), fingerprint(value));
}

Decoded decode(const char* p, const char* end) {
  Decoded d;
  std::string count, flag;
  if (!get(p, end, d.error) || !get(p, end, count)) return {"its agreement could not be read (another gpuops?)", {}};
  const size_t n = std::strtoull(count.c_str(), nullptr, 10);
  for (size_t i = 0; i < n; ++i) {
    Decoded::Field f;
    if (!get(p, end, flag) || !get(p, end, f.name) || !get(p, end, f.value))
      return {"its agreement could not be read (another gpuops?)", {}};
    f.compared = flag == "1";
    d.fields.push_back(std::move(f));
  }
  return d;
}

}  // namespace

std::string fingerprint(const std::string& bytes) {
  uint64_t h = 0xcbf29ce484222325ull;
  for (unsigned char c : bytes) h = (h ^ c) * 0x100000001b3ull;
  return fmt::format("{:016x}", h);
}

std::string random_id() {
  std::random_device device;
  return fmt::format("{:08x}{:08x}", device(), device());
}

std::string fingerprint(const std::vector<at::Tensor>& tensors) {
  at::NoGradGuard no_grad;
  // Each element's bits times a weight that depends on its position and tensor: an odd multiplier, then an
  // xor-shift (wrapping int64 arithmetic; both steps invertible), so that no two positions share a weight and a swap of two elements
  // changes the sum (a weight repeating every 65521 positions let such a swap pass unseen).
  constexpr int64_t kChunk = int64_t{1} << 22;
  constexpr auto kOdd = static_cast<int64_t>(0x9E3779B97F4A7C15ull), kTensor = static_cast<int64_t>(0xC2B2AE3D27D4EB4Full);
  const auto integer = [](const at::Tensor& t) {  // the same bits as integers of the same size
    switch (t.element_size()) {
      case 1: return t.view(at::kByte);
      case 2: return t.view(at::kShort);
      case 4: return t.view(at::kInt);
      default: return t.view(at::kLong);
    }
  };
  at::Tensor total;
  for (size_t i = 0; i < tensors.size(); ++i) {
    const at::Tensor& t = tensors[i];
    if (!t.defined() || t.numel() == 0) continue;
    TORCH_CHECK_VALUE(!t.is_complex() && t.element_size() <= 8, "gpuops::dist::fingerprint: tensors[", i, "] is ",
                      t.scalar_type(), "; accepted: real dtypes");
    if (!total.defined()) total = at::zeros({}, at::TensorOptions(at::kLong).device(t.device()));
    const at::Tensor bits = integer(t.detach().contiguous().reshape({-1}));
    for (int64_t begin = 0; begin < bits.numel(); begin += kChunk) {
      const int64_t len = std::min(kChunk, bits.numel() - begin);
      at::Tensor weight = at::arange(begin, begin + len, total.options()).mul_(kOdd).add_(
          static_cast<int64_t>(static_cast<uint64_t>(i) * static_cast<uint64_t>(kTensor) + 1));
      weight.bitwise_xor_(weight.bitwise_right_shift(31).bitwise_and_((int64_t{1} << 33) - 1));  // a logical shift
      // (out of place: for 8-byte dtypes .to() returns the caller's own bits, which mul_ overwrote)
      total.add_(bits.narrow(0, begin, len).to(total.device(), at::kLong).mul(weight).sum());
    }
  }
  return fmt::format("{:016x}", total.defined() ? static_cast<uint64_t>(total.item<int64_t>()) : uint64_t{0});
}

Agreement& Agreement::field(std::string name, std::string value) {
  fields_.push_back({std::move(name), bounded(value), true});
  return *this;
}

Agreement& Agreement::propose(std::string name, std::string value) {
  fields_.push_back({std::move(name), bounded(value), false});
  return *this;
}

Agreement& Agreement::fail(std::string error) {
  if (!error_.empty()) return *this;
  // Its first line that says something (a message may begin with a line break).
  const size_t begin = std::min(error.find_first_not_of(" \t\r\n"), error.size());
  error_ = error.substr(begin, std::min(error.find('\n', begin) - begin, kMaxError));
  if (error_.empty()) error_ = "failed";
  return *this;
}

bool Agreement::check(const std::function<void()>& check) {
  if (failed()) return false;
  try {
    check();
    return true;
  } catch (const c10::Error& e) {
    fail(e.what_without_backtrace());
    caught_ = std::current_exception();
  } catch (const std::exception& e) {
    fail(e.what());
    caught_ = std::current_exception();
  } catch (...) {  // whatever it is, this rank failed: the others must hear of it
    fail("an exception that is not a std::exception");
    caught_ = std::current_exception();
  }
  return false;
}

std::vector<std::string> all_gather_bytes(Communicator& checked, const std::string& mine) {
  memory::UnbudgetedEverywhere unbudgeted;  // a rank at its memory budget's limit still reaches the others
  Communicator comm = checked.unchecked();  // the lengths come first: the blobs' all-gather agrees by construction
  const int n = comm.size();
  const at::Device device = comm.control_device();
  // Two all-gathers: every rank's length, then every blob padded to the longest.
  at::Tensor lengths = at::empty({n}, at::TensorOptions(at::kLong).device(device));
  comm.all_gather(at::tensor({static_cast<int64_t>(mine.size())}, at::kLong).to(device), lengths).wait();
  lengths = lengths.cpu();
  const int64_t longest = std::max<int64_t>(1, lengths.max().item<int64_t>());
  at::Tensor blob = at::zeros({longest}, at::kByte);
  if (!mine.empty()) std::memcpy(blob.data_ptr<uint8_t>(), mine.data(), mine.size());
  at::Tensor all = at::empty({n * longest}, at::TensorOptions(at::kByte).device(device));
  comm.all_gather(blob.to(device), all).wait();
  all = all.cpu();
  std::vector<std::string> out;
  for (int r = 0; r < n; ++r) {
    const char* begin = reinterpret_cast<const char*>(all.data_ptr<uint8_t>()) + r * longest;
    out.emplace_back(begin, static_cast<size_t>(lengths[r].item<int64_t>()));
  }
  return out;
}

Agreement::Proposals Agreement::exchange(Communicator& checked) const {
  Communicator comm = checked.unchecked();  // its all-gathers agree by construction
  std::string mine;
  put(mine, error_);
  put(mine, std::to_string(fields_.size()));
  for (const auto& f : fields_) {
    put(mine, f.compared ? "1" : "0");
    put(mine, f.name);
    put(mine, f.value);
  }
  const int n = comm.size();
  std::vector<std::string> blobs;
  try {
    blobs = all_gather_bytes(comm, mine);
  } catch (const c10::DistBackendError& e) {  // named as the call the user made, with the usual causes
    C10_THROW_ERROR(DistBackendError,
                    fmt::format("{}: the ranks did not all take part (a rank stalled or died, raised before this "
                                "call, or made it differently, e.g. TrainingState.save without the sharded "
                                "optimizer and without process_group, which writes alone): {}",
                                what_, e.what_without_backtrace()));
  }
  std::vector<Decoded> ranks;
  for (const auto& blob : blobs) ranks.push_back(decode(blob.data(), blob.data() + blob.size()));

  const auto failing = std::find_if(ranks.begin(), ranks.end(), [](const Decoded& d) { return !d.error.empty(); });
  if (failed()) {  // this rank's own failure, as it was raised
    if (caught_) std::rethrow_exception(caught_);
    TORCH_CHECK_VALUE(false, what_, ": ", error_);
  }
  if (failing != ranks.end())
    TORCH_CHECK_VALUE(false, what_, ": rank ", failing - ranks.begin(), " failed: ", failing->error,
                      "; nothing was changed on any rank");
  const auto& first = ranks[0].fields;
  for (int r = 1; r < n; ++r) {
    const auto& theirs = ranks[r].fields;
    // Field by field first: ranks on different paths (a sharded optimizer on some only) differ in a field
    // before they differ in the count.
    for (size_t i = 0; i < std::min(first.size(), theirs.size()); ++i) {
      TORCH_CHECK_VALUE(theirs[i].name == first[i].name, what_, ": rank ", r, " compares '", theirs[i].name,
                        "' where rank 0 compares '", first[i].name, "': the ranks run different versions of gpuops");
      TORCH_CHECK_VALUE(!first[i].compared || theirs[i].value == first[i].value, what_, ": the ranks disagree on ",
                        first[i].name, ": rank 0 has ", first[i].value, ", rank ", r, " has ", theirs[i].value,
                        "; every rank must have the same. Nothing was changed on any rank");
    }
    TORCH_CHECK_VALUE(theirs.size() == first.size(), what_, ": rank ", r, " compares ", theirs.size(),
                      " fields, rank 0 ", first.size(), ": the ranks run different versions of gpuops; nothing was "
                      "changed on any rank");
  }
  Proposals proposals;
  for (const auto& f : first)
    if (!f.compared) proposals.emplace_back(f.name, f.value);
  return proposals;
}

}  // namespace gpuops::dist
