// gpuops::optim::ZeroShards (zero_optimizer.h), the checkpoint side: one file per rank with the layout,
// online resharding from the files of a job of any world size, the consolidated per-parameter state.
//
// Every state tensor of a shard parameter is either element-wise (one value per element of the shard: its
// numel is the shard's), per block (an 8-bit state's scales: one per kStateBlock elements, in a buffer laid out
// in whole blocks, every parameter and shard starting on one) or the step counters, one per parameter of the
// buffer (the same on every rank; files written before per-parameter counters hold one for the whole buffer).
// The layout of a flat
// buffer (each parameter's offset and size) does not depend on the world size, only the padding at its end
// does, so the element at offset i of a buffer is the same element in every job: resharding is copying
// ranges.
#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <functional>
#include <sstream>
#include <string>
#include <unistd.h>

#include <ATen/ATen.h>
#include <c10/core/GradMode.h>
#include <c10/util/Exception.h>
#include <c10/util/accumulate.h>
#include <torch/serialize/input-archive.h>
#include <torch/serialize/output-archive.h>

#include "../common/file_checks.h"
#include "../state/archive_file.h"
#include "../state/posix_files.h"
#include "gpuops/agreement.h"
#include "gpuops/fused_adam8.h"
#include "gpuops/zero_optimizer.h"

namespace gpuops::optim {
namespace {

constexpr int64_t kFormat = 1;
constexpr const char* kMaster = "master_param";
constexpr const char* kStep = "step";  // the per-parameter step counters: not element-wise, whatever their length

// A buffer's layout: the offsets of its parameters, then their sizes (world-size independent).
at::Tensor layout_of(const FlatParams::Bucket& b) {
  std::vector<int64_t> v;
  for (const auto& s : b.slots) v.push_back(s.offset);
  for (const auto& s : b.slots) v.push_back(s.numel);
  return at::tensor(v, at::kLong);
}

// Where the last parameter of a buffer ends: the padding after it depends on the world size.
int64_t used_end(const FlatParams::Bucket& b) { return b.slots.back().offset + b.slots.back().numel; }

// Each parameter's dimension count then sizes, one flat list.
at::Tensor shapes_of(const ZeroShards& z, size_t k) {
  std::vector<int64_t> v;
  for (size_t i = 0; i < z.bucket(k).slots.size(); ++i) {
    const auto sizes = z.param_sizes(k, i);
    v.push_back(static_cast<int64_t>(sizes.size()));
    for (int64_t d : sizes) v.push_back(d);
  }
  return at::tensor(v, at::kLong);
}

std::vector<std::vector<int64_t>> decode_shapes(const at::Tensor& t) {
  std::vector<std::vector<int64_t>> shapes;
  const auto* v = t.data_ptr<int64_t>();
  for (int64_t i = 0; i < t.numel();) {
    const int64_t dims = v[i++];
    TORCH_CHECK_VALUE(dims >= 0 && dims <= t.numel() - i, "ZeroOptimizer: a shard file's shapes are damaged (a "
                      "parameter of ", dims, " dimensions where ", t.numel() - i, " values remain)");
    shapes.emplace_back(v + i, v + i + dims);
    i += dims;
  }
  return shapes;
}

// Elements per entry of a state tensor named `name`: kStateBlock for an 8-bit state's scales, else 1.
int64_t per_entry(const std::string& name) { return is_state_scales(name) ? kStateBlock : 1; }

// A state tensor with one entry per `per_entry` elements of a shard of `s` elements (else: the same on every rank).
bool sharded_field(const std::string& name, const at::Tensor& t, int64_t s) {
  return name != kStep && t.dim() == 1 && s % per_entry(name) == 0 && t.numel() == s / per_entry(name);
}

std::string join(const NamedTensors& state) {
  std::string names;
  for (const auto& [name, t] : state)
    if (t.defined()) names += (names.empty() ? "" : ",") + name;
  return names;
}

std::vector<std::string> split(const std::string& names) {
  std::vector<std::string> out;
  std::stringstream in(names);
  for (std::string name; std::getline(in, name, ',');) out.push_back(name);
  return out;
}

c10::IValue read_value(torch::serialize::InputArchive& a, const std::string& key, const std::string& file) {
  c10::IValue v;
  TORCH_CHECK_VALUE(a.try_read(key, v), "ZeroOptimizer: ", file, " has no '", key,
                    "': it is not a ZeroOptimizer shard file");
  return v;
}

// One saved rank's file, read whole and checked against this job's layout.
struct SavedShard {
  torch::serialize::InputArchive archive;
  std::vector<torch::serialize::InputArchive> buckets;  // their "state" archives
  std::vector<std::vector<std::string>> fields;
  std::vector<int64_t> numels;  // padded buffer lengths in the saving job
};

}  // namespace

void ZeroShards::write_shard(torch::serialize::OutputArchive& archive, const std::string& kind,
                             const std::vector<NamedTensors>& states, const torch::optim::OptimizerOptions& options) const {
  TORCH_CHECK_VALUE(states.size() == shards_.size(), "ZeroShards::write_shard: ", states.size(), " states for ",
                    shards_.size(), " flat buffers");
  archive.write("format", c10::IValue(kFormat));
  archive.write("kind", c10::IValue(kind));
  archive.write("world_size", c10::IValue(static_cast<int64_t>(comm_.size())));
  archive.write("rank", c10::IValue(static_cast<int64_t>(comm_.rank())));
  archive.write("stage", c10::IValue(static_cast<int64_t>(options_.stage)));
  // Which save this is: every rank of one save writes the same (a load refuses files of several saves).
  archive.write("optimizer_id", c10::IValue(id_));
  archive.write("steps", c10::IValue(steps_));
  archive.write("buckets", c10::IValue(static_cast<int64_t>(shards_.size())));
  torch::serialize::OutputArchive saved_options;
  options.serialize(saved_options);
  archive.write("options", saved_options);
  for (size_t k = 0; k < shards_.size(); ++k) {
    const auto& b = bucket(k);
    torch::serialize::OutputArchive out, state;
    out.write("dtype", c10::IValue(static_cast<int64_t>(b.dtype)));
    out.write("numel", c10::IValue(b.data.numel()));
    out.write("layout", c10::IValue(layout_of(b)));
    out.write("shapes", c10::IValue(shapes_of(*this, k)));
    std::string names;
    for (size_t i = 0; i < b.slots.size(); ++i)
      if (!options_.param_names.empty()) names += (i ? "\n" : "") + options_.param_names[param_of_slot_[k][i]];
    out.write("names", c10::IValue(names));
    for (const auto& [name, t] : states[k])
      if (t.defined()) state.write(name, c10::IValue(t.detach().to(at::kCPU)));
    out.write("fields", c10::IValue(join(states[k])));
    out.write("state", state);
    archive.write("bucket." + std::to_string(k), out);
  }
}

void ZeroShards::save_shard(const std::string& path, const std::string& kind, const std::vector<NamedTensors>& states,
                            const torch::optim::OptimizerOptions& options) const {
  TORCH_CHECK_VALUE(gpuops::detail::path_problem(path).empty(), "ZeroOptimizer.save_shard: path '",
                    path.substr(0, path.find('\0')), "\\0...' holds a NUL byte (C would write another file)");
  // Only a regular file (or nothing) is replaced: the rename below would put a regular file in place of a
  // device node, a FIFO or a symbolic link (as root, /dev/zero itself), and cannot replace a folder.
  const auto target = gpuops::detail::path_kind(path);
  TORCH_CHECK_VALUE(!target.exists || target.regular, "ZeroOptimizer.save_shard: ", path, " is ",
                    target.folder ? "a folder" : "not a regular file (a symbolic link, FIFO, socket or device)",
                    "; accepted: a new path, or a regular file to replace");
  torch::serialize::OutputArchive archive;
  write_shard(archive, kind, states, options);
  // Complete or absent: a temporary name of this writer alone (two writers in one folder never share one),
  // renamed into place (TrainingState adds checksums and durability).
  const std::string tmp = gpuops::detail::temporary_name(path);
  try {
    gpuops::detail::save_archive(archive, tmp);
  } catch (const c10::Error& e) {
    TORCH_CHECK(false, "ZeroOptimizer.save_shard: cannot write ", path, " (", e.what_without_backtrace(), ")");
  }
  if (std::rename(tmp.c_str(), path.c_str()) != 0) {
    const int error = errno;
    gpuops::detail::remove_file(tmp);
    TORCH_CHECK(false, "ZeroOptimizer.save_shard: cannot rename ", tmp, " to ", path, ": ", std::strerror(error));
  }
}

ZeroShards::ReadShards ZeroShards::read_shards(const std::vector<std::string>& files, const std::string& kind,
                                               bool allow_reshard) const {
  const auto n_old = static_cast<int64_t>(files.size());
  TORCH_CHECK_VALUE(n_old >= 1, "ZeroOptimizer.load_shards: files must list the shard file of every rank of the "
                    "saving job, got none");
  TORCH_CHECK_VALUE(n_old == comm_.size() || allow_reshard, "ZeroOptimizer.load_shards: the state was saved by ",
                    n_old, " ranks and this job has ", comm_.size(), "; resharding changes each rank's shard "
                    "(exactly, online): allow it with allow_reshard=true");
  const auto load = [&](int64_t r, torch::serialize::InputArchive& archive) {
    // A FIFO would block the read forever, a directory or device fail obscurely: refused first, named.
    const std::string problem = gpuops::detail::readable_file_problem(files[r]);
    TORCH_CHECK_VALUE(problem.empty(), "ZeroOptimizer.load_shards: files[", r, "] '",
                      files[r].substr(0, files[r].find('\0')), "' ", problem);
    try {
      archive.load_from(files[r]);
    } catch (const c10::Error& e) {
      TORCH_CHECK_VALUE(false, "ZeroOptimizer.load_shards: cannot read ", files[r], " (", e.what_without_backtrace(),
                        ")");
    }
  };
  return read_from(n_old, load, [&](int64_t r) { return files[r]; }, kind, "ZeroOptimizer.load_shards");
}

ZeroShards::ReadShards ZeroShards::read_own(torch::serialize::InputArchive& archive, const std::string& kind) const {
  bool taken = false;
  const auto load = [&](int64_t r, torch::serialize::InputArchive& into) {
    TORCH_CHECK_VALUE(r == comm_.rank() && !taken, "ZeroOptimizer.load: the archive is not this rank's shard");
    into = std::move(archive);
    taken = true;
  };
  return read_from(comm_.size(), load, [](int64_t) { return std::string("the archive"); }, kind, "ZeroOptimizer.load");
}

ZeroShards::ReadShards ZeroShards::read_from(int64_t n_old, const ShardLoader& load,
                                             const std::function<std::string(int64_t)>& name_of,
                                             const std::string& kind, const std::string& where) const {
  std::vector<std::unique_ptr<SavedShard>> opened(n_old);
  ReadShards result;
  std::string checkpoint_file;  // the first file opened: the others must come from its save
  const auto read_file = [&](int64_t r) -> SavedShard& {
    const std::string file = name_of(r);
    auto s = std::make_unique<SavedShard>();
    load(r, s->archive);
    auto& a = s->archive;
    c10::IValue id, steps;
    const std::string checkpoint = a.try_read("optimizer_id", id) && a.try_read("steps", steps) && id.isString() &&
                                           steps.isInt()
                                       ? id.toStringRef() + ":" + std::to_string(steps.toInt())
                                       : "unknown";
    if (checkpoint_file.empty()) {
      checkpoint_file = file;
      result.checkpoint = checkpoint;
      result.steps = steps.isInt() ? std::max<int64_t>(0, steps.toInt()) : 0;
    }
    TORCH_CHECK_VALUE(checkpoint == result.checkpoint, where, ": ", file, " comes from another save than ",
                      checkpoint_file, " (optimizer id and steps ", checkpoint, " and ", result.checkpoint,
                      "); files must list the files of one save");
    TORCH_CHECK_VALUE(read_value(a, "format", file).toInt() == kFormat, where, ": ", file, " has format ",
                      read_value(a, "format", file).toInt(), "; this build reads format ", kFormat);
    const std::string saved_kind = read_value(a, "kind", file).toStringRef();
    TORCH_CHECK_VALUE(saved_kind == kind, where, ": ", file, " holds the state of a ", saved_kind,
                      " optimizer; this one is ", kind);
    TORCH_CHECK_VALUE(read_value(a, "world_size", file).toInt() == n_old && read_value(a, "rank", file).toInt() == r,
                      where, ": files[", r, "] = ", file, " is rank ", read_value(a, "rank", file).toInt(), " of ",
                      read_value(a, "world_size", file).toInt(), " ranks; files must list the ", n_old,
                      " files of one save in rank order");
    TORCH_CHECK_VALUE(read_value(a, "buckets", file).toInt() == static_cast<int64_t>(shards_.size()), where, ": ",
                      file, " has ", read_value(a, "buckets", file).toInt(), " buckets; these parameters make ",
                      shards_.size(), " (another model, parameters of other dtypes, or another bucket_bytes)");
    for (size_t k = 0; k < shards_.size(); ++k) {
      torch::serialize::InputArchive saved, state;
      a.read("bucket." + std::to_string(k), saved);
      const auto& mine = this->bucket(k);
      // Names and shapes first: an error that names the parameter that differs.
      const auto shapes = decode_shapes(read_value(saved, "shapes", file).toTensor());
      std::vector<std::string> names;
      {
        std::stringstream in(read_value(saved, "names", file).toStringRef());
        for (std::string name; std::getline(in, name, '\n');) names.push_back(name);
      }
      TORCH_CHECK_VALUE(names.empty() || names.size() == shapes.size(), where, ": ", file, " lists ", names.size(),
                        " names for the ", shapes.size(), " parameters of its bucket ", k, ": it is damaged");
      TORCH_CHECK_VALUE(shapes.size() == mine.slots.size(), where, ": ", file, " was saved for other parameters: its "
                        "bucket ", k, " holds ", shapes.size(), " parameters, here ", mine.slots.size(), " (from ",
                        describe(k, 0), "; another model, or another bucket_bytes)");
      for (size_t i = 0; i < shapes.size(); ++i) {
        const bool named = !names.empty() && !options_.param_names.empty();
        TORCH_CHECK_VALUE(!named || names[i] == options_.param_names[param_of_slot_[k][i]], where, ": ", file,
                          " was saved for other parameters: it has '", names[i], "' where this optimizer has ",
                          describe(k, i));
        TORCH_CHECK_VALUE(param_sizes(k, i).vec() == shapes[i], where, ": ", file, " was saved for other "
                          "parameters: ", describe(k, i), " has shape ", c10::IntArrayRef(shapes[i]), " in the file");
      }
      const at::Tensor layout = read_value(saved, "layout", file).toTensor();
      TORCH_CHECK_VALUE(read_value(saved, "dtype", file).toInt() == static_cast<int64_t>(mine.dtype) &&
                            layout.sizes() == layout_of(mine).sizes() && at::equal(layout, layout_of(mine)),
                        where, ": ", file, " was saved for other parameters (bucket ", k, " has another dtype, "
                        "parameter count, or parameter sizes; or another bucket_bytes)");
      const int64_t numel = read_value(saved, "numel", file).toInt();
      TORCH_CHECK_VALUE(numel % n_old == 0 && numel >= used_end(mine), where, ": ", file,
                        " has a flat buffer of ", numel, " elements, which does not fit its layout");
      s->fields.push_back(split(read_value(saved, "fields", file).toStringRef()));
      saved.read("state", state);
      s->buckets.push_back(std::move(state));
      s->numels.push_back(numel);
    }
    opened[r] = std::move(s);
    return *opened[r];
  };
  // A file that is not what it claims (crafted, damaged) makes torch's archive raise without naming it.
  const auto open = [&](int64_t r) -> SavedShard& {
    if (opened[r]) return *opened[r];
    try {
      return read_file(r);
    } catch (const c10::ValueError&) {
      throw;
    } catch (const c10::Error& e) {
      const std::string what = e.what_without_backtrace();
      TORCH_CHECK_VALUE(false, where, ": ", name_of(r), " is damaged or not a ZeroOptimizer shard file (",
                        what.substr(0, what.find('\n')), ")");
    }
  };

  result.saved_world_size = static_cast<int>(n_old);
  for (size_t k = 0; k < shards_.size(); ++k) {
    const int64_t s = shards_[k].numel(), lo = comm_.rank() * s, hi = lo + s;
    // The saved rank holding this shard's first element (the last one when it is all new padding): the
    // reference for the fields, the shared scalars and the options.
    const int64_t guess = lo / std::max<int64_t>(1, s);
    SavedShard& first_file = open(std::min(n_old - 1, guess));
    const int64_t old_s = first_file.numels[k] / n_old;
    const int64_t ref = std::min(n_old - 1, lo / old_s);
    SavedShard& reference = open(ref);
    if (k == 0)
      TORCH_CHECK_VALUE(reference.archive.try_read("options", result.options), where, ": ", name_of(ref),
                        " has no 'options': it is damaged or not a ZeroOptimizer shard file");
    NamedTensors state;
    for (const std::string& name : reference.fields[k]) {
      const at::Tensor first = read_value(reference.buckets[k], name, name_of(ref)).toTensor();
      if (!sharded_field(name, first, old_s)) {  // the same in every file
        state[name] = first.to(shards_[k].device());
        continue;
      }
      // Copied in entries (an 8-bit state's scales: whole blocks, the shards of both jobs starting on one).
      const int64_t per = per_entry(name);
      TORCH_CHECK_VALUE(s % per == 0, where, ": '", name, "' of flat buffer ", k, " has one entry per ", per,
                        " elements, but this job's shards are not laid out in whole blocks of ", per,
                        " (construct the optimizer with the state_bits the state was saved with)");
      at::Tensor out = at::zeros({s / per}, first.options().device(shards_[k].device()));  // padding stays zero
      for (int64_t q = std::max<int64_t>(0, lo / old_s); q < n_old && q * old_s < hi; ++q) {
        const int64_t from = std::max(lo, q * old_s), to = std::min(hi, (q + 1) * old_s);
        if (from >= to) continue;
        SavedShard& saved = open(q);
        c10::IValue v;
        TORCH_CHECK_VALUE(saved.buckets[k].try_read(name, v) && v.isTensor() && v.toTensor().numel() == old_s / per,
                          where, ": ", name_of(q), " lacks '", name, "' of flat buffer ", k, " that ", name_of(ref),
                          " has");
        out.narrow(0, (from - lo) / per, (to - from) / per)
            .copy_(v.toTensor().narrow(0, (from - q * old_s) / per, (to - from) / per));
      }
      state[name] = out;
    }
    result.states.push_back(std::move(state));
  }
  return result;
}

namespace {
std::vector<std::pair<std::string, at::Tensor>> read_full_parameters_of(const std::vector<std::string>& files,
                                                                        const std::string& where) {
  const auto n = static_cast<int64_t>(files.size());
  TORCH_CHECK_VALUE(n >= 1, where, ": files must list the shard file of every rank of one save, got none");
  std::vector<torch::serialize::InputArchive> archives(files.size());
  std::string save;  // "<optimizer id>:<steps>" of files[0]
  for (int64_t r = 0; r < n; ++r) {
    const std::string problem = gpuops::detail::readable_file_problem(files[r]);
    TORCH_CHECK_VALUE(problem.empty(), where, ": files[", r, "] '", files[r].substr(0, files[r].find('\0')), "' ", problem);
    try {
      archives[r].load_from(files[r], at::kCPU);
    } catch (const c10::Error& e) {
      const std::string what = e.what_without_backtrace();
      TORCH_CHECK_VALUE(false, where, ": ", files[r], " is damaged or not a ZeroOptimizer shard file (",
                        what.substr(0, what.find('\n')), ")");
    }
    auto& a = archives[r];
    TORCH_CHECK_VALUE(read_value(a, "format", files[r]).toInt() == kFormat, where, ": ", files[r], " has format ",
                      read_value(a, "format", files[r]).toInt(), "; this build reads format ", kFormat);
    TORCH_CHECK_VALUE(read_value(a, "world_size", files[r]).toInt() == n && read_value(a, "rank", files[r]).toInt() == r,
                      where, ": files[", r, "] = ", files[r], " is rank ", read_value(a, "rank", files[r]).toInt(),
                      " of ", read_value(a, "world_size", files[r]).toInt(), "; files must list the ", n,
                      " files of one save in rank order");
    const std::string id = read_value(a, "optimizer_id", files[r]).toStringRef() + ":" +
                           std::to_string(read_value(a, "steps", files[r]).toInt());
    if (r == 0) save = id;
    TORCH_CHECK_VALUE(id == save, where, ": ", files[r], " comes from another save than ", files[0]);
  }
  std::vector<std::pair<std::string, at::Tensor>> out;
  const int64_t buckets = read_value(archives[0], "buckets", files[0]).toInt();
  for (int64_t k = 0; k < buckets; ++k) {
    const std::string key = "bucket." + std::to_string(k);
    std::vector<at::Tensor> parts;  // each rank's shard of the buffer's fp32 values
    torch::serialize::InputArchive first;
    for (int64_t r = 0; r < n; ++r) {
      torch::serialize::InputArchive bucket, state;
      TORCH_CHECK_VALUE(archives[r].try_read(key, bucket), where, ": ", files[r], " lacks ", key, " that ", files[0],
                        " has");
      const auto fields = split(read_value(bucket, "fields", files[r]).toStringRef());
      if (std::find(fields.begin(), fields.end(), kMaster) == fields.end()) break;  // the model holds these
      bucket.read("state", state);
      parts.push_back(read_value(state, kMaster, files[r]).toTensor().reshape({-1}).to(at::kFloat));
      if (r == 0) first = std::move(bucket);
    }
    if (parts.size() != static_cast<size_t>(n)) {
      TORCH_CHECK_VALUE(parts.empty(), where, ": ", key, " has fp32 values in ", parts.size(), " of the ", n, " files");
      continue;
    }
    const at::Tensor flat = at::cat(parts);
    const auto shapes = decode_shapes(read_value(first, "shapes", files[0]).toTensor());
    const at::Tensor layout = read_value(first, "layout", files[0]).toTensor().to(at::kLong);
    std::vector<std::string> names;
    std::stringstream in(read_value(first, "names", files[0]).toStringRef());
    for (std::string name; std::getline(in, name, '\n');) names.push_back(name);
    TORCH_CHECK_VALUE(!names.empty(), where, ": ", files[0], " was saved without parameter names (give "
                      "ZeroOptimizer the named parameters, as model.named_parameters()): nothing to name them by");
    const auto slots = static_cast<int64_t>(shapes.size());
    TORCH_CHECK_VALUE(names.size() == shapes.size() && layout.numel() == 2 * slots, where, ": ", files[0], "'s ",
                      key, " is damaged (", names.size(), " names, ", slots, " shapes, ", layout.numel(), " layout values)");
    for (int64_t i = 0; i < slots; ++i) {
      const int64_t offset = layout[i].item<int64_t>(), numel = layout[slots + i].item<int64_t>();
      const bool sized = std::all_of(shapes[i].begin(), shapes[i].end(), [](int64_t d) { return d >= 0; }) &&
                         c10::multiply_integers(shapes[i]) == numel;
      TORCH_CHECK_VALUE(sized && offset >= 0 && numel >= 0 && offset <= flat.numel() - numel,
                        where, ": ", files[0], "'s ", key, " is damaged (parameter '", names[i], "')");
      out.emplace_back(names[i], flat.narrow(0, offset, numel).view(shapes[i]).clone());
    }
  }
  return out;
}
}  // namespace

std::vector<std::pair<std::string, at::Tensor>> read_full_parameters(const std::vector<std::string>& files) {
  const std::string where = "read_full_parameters";
  try {
    return read_full_parameters_of(files, where);
  } catch (const c10::ValueError&) {
    throw;
  } catch (const c10::Error& e) {  // a value of another type where the format has one (a crafted file)
    const std::string what = e.what_without_backtrace();
    TORCH_CHECK_VALUE(false, where, ": the files are damaged or not ZeroOptimizer shard files (",
                      what.substr(0, what.find('\n')), ")");
  }
}

std::vector<NamedTensors> ZeroShards::consolidate(const std::vector<NamedTensors>& states, int to) {
  dist::Agreement agreement("ZeroOptimizer.consolidate_state_dict");
  agreement.check([&] {
    TORCH_CHECK_VALUE(to >= 0 && to < comm_.size(), "ZeroOptimizer.consolidate_state_dict: to must be a rank in [0, ",
                      comm_.size(), "), got ", to);
    TORCH_CHECK_VALUE(states.size() == shards_.size(), "ZeroShards::consolidate: ", states.size(), " states for ",
                      shards_.size(), " flat buffers");
  });
  agreement.field("to", std::to_string(to)).exchange(comm_);
  const bool mine = comm_.rank() == to;
  const int n = comm_.size();
  c10::NoGradGuard no_grad;
  // Per buffer and field: the whole buffer's values on `to`'s host, gathered kReduceChunk elements per rank
  // at a time through the device (every rank takes part; the map's order is the same on every rank).
  std::vector<std::map<std::string, at::Tensor>> whole(shards_.size());
  for (size_t k = 0; k < shards_.size(); ++k) {
    for (const auto& [name, t] : states[k]) {
      if (!t.defined()) continue;
      if (!sharded_field(name, t, shards_[k].numel())) {
        if (mine) whole[k][name] = t.detach().to(at::kCPU, /*non_blocking=*/false, /*copy=*/true);
        continue;
      }
      const int64_t s = t.numel();  // entries (an 8-bit state's scales: blocks)
      at::Tensor host = mine ? at::empty({n, s}, t.options().device(at::kCPU)) : at::Tensor();
      // (offload: host states travel through the device NCCL gathers on)
      const at::Device through = n > 1 && t.is_cpu() ? comm_.control_device() : t.device();
      for (int64_t begin = 0; begin < s; begin += kReduceChunk) {
        const int64_t len = std::min(kReduceChunk, s - begin);
        at::Tensor part = t.narrow(0, begin, len).to(through).contiguous();
        at::Tensor all = at::empty({n * len}, part.options());
        comm_.all_gather(part, all).wait();
        if (mine) host.narrow(1, begin, len).copy_(all.view({n, len}));
      }
      if (mine) whole[k][name] = host.view({-1});
    }
  }
  std::vector<NamedTensors> per_param;
  if (!mine) return per_param;
  for (const auto& [k, slot_index] : slot_of_param_) {
    const auto& slot = bucket(k).slots[slot_index];
    NamedTensors state;
    for (const auto& [name, t] : whole[k]) {
      if (name == kStep) {
        state[name] = t.dim() == 1 ? t.select(0, static_cast<int64_t>(slot_index)).clone() : t.clone();
      } else if (t.dim() != 1) {
        state[name] = t.clone();
      } else if (per_entry(name) > 1) {  // the parameter's own blocks: it starts on one
        state[name] = t.narrow(0, slot.offset / per_entry(name), state_blocks(slot.numel)).clone();
      } else {
        state[name] = t.narrow(0, slot.offset, slot.numel).view(param_sizes(k, slot_index)).clone();
      }
    }
    // A parameter never stepped has no state, as in torch's optimizers (whose state_dict omits it).
    const auto step = state.find(kStep);
    if (step != state.end() && step->second.eq(0).all().item<bool>()) state.clear();
    per_param.push_back(std::move(state));
  }
  return per_param;
}

std::vector<NamedTensors> ZeroShards::shard_states_of(const std::vector<NamedTensors>& per_param) const {
  const std::string where = "ZeroOptimizer.load_state_dict";
  TORCH_CHECK_VALUE(per_param.size() == slot_of_param_.size(), where, ": the state has ", per_param.size(),
                    " parameters; this optimizer has ", slot_of_param_.size());
  std::vector<NamedTensors> states(shards_.size());
  // The first parameter with a state in each buffer: the reference for the fields. A parameter without one
  // (torch's optimizers keep none for a parameter never stepped) starts afresh: zeros, step 0.
  std::vector<int64_t> first_of(shards_.size(), -1);
  for (size_t i = 0; i < per_param.size(); ++i)
    if (first_of[slot_of_param_[i].first] < 0 && !per_param[i].empty()) first_of[slot_of_param_[i].first] = static_cast<int64_t>(i);
  for (size_t i = 0; i < per_param.size(); ++i) {
    const auto [k, slot_index] = slot_of_param_[i];
    if (first_of[k] < 0) continue;  // no parameter of this buffer has a state
    const auto& slot = bucket(k).slots[slot_index];
    const int64_t s = shards_[k].numel(), lo = comm_.rank() * s;
    const NamedTensors& ref = per_param[first_of[k]];
    const NamedTensors& given = per_param[i];
    TORCH_CHECK_VALUE(given.empty() || (given.size() == ref.size() &&
                                        std::equal(given.begin(), given.end(), ref.begin(),
                                                   [](const auto& a, const auto& b) { return a.first == b.first; })),
                      where, ": state[", i, "] has the fields {", join(given), "} but state[", first_of[k], "] has {",
                      join(ref), "}; the parameters of one flat buffer (same device and dtype) step together");
    for (const auto& [name, t] : given) {
      const bool codes = is_state_codes(name);
      TORCH_CHECK_VALUE(t.defined() && (codes ? t.scalar_type() == at::kByte : t.is_floating_point()), where,
                        ": state[", i, "]['", name, "'] must be a ", codes ? "uint8" : "floating", " tensor");
      if (per_entry(name) > 1) {  // an 8-bit state's scales: the parameter's blocks (it starts on one)
        const int64_t per = per_entry(name);
        TORCH_CHECK_VALUE(t.dim() == 1 && t.numel() == state_blocks(slot.numel), where, ": state[", i, "]['", name,
                          "'] must hold ", state_blocks(slot.numel), " scales (one per ", per, " elements), got shape ",
                          t.sizes());
        TORCH_CHECK_VALUE(blocked(k), where, ": state[", i, "]['", name, "'] is an 8-bit state, but ",
                          describe(k, slot_index), " is not in a buffer laid out in whole blocks (state_bits=8 "
                          "parameters of ", kMin8BitNumel, " elements or more are)");
        at::Tensor& out = states[k][name];
        if (!out.defined()) out = at::zeros({s / per}, shards_[k].options().requires_grad(false));
        const int64_t from = std::max(lo, slot.offset) / per;
        const int64_t to = std::min(lo + s, slot.offset + state_blocks(slot.numel) * per) / per;
        if (from < to) out.narrow(0, from - lo / per, to - from).copy_(t.detach().narrow(0, from - slot.offset / per, to - from));
        continue;
      }
      if (name == kStep || t.numel() != slot.numel) {
        TORCH_CHECK_VALUE(name == kStep, where, ": state[", i, "]['", name, "'] has shape ", t.sizes(),
                          " but its parameter has shape ", param_sizes(k, slot_index));
        TORCH_CHECK_VALUE(t.numel() == 1, where, ": state[", i, "]['step'] must be one number, got shape ", t.sizes());
        at::Tensor& counters = states[k][name];
        if (!counters.defined())
          counters = at::zeros({static_cast<int64_t>(bucket(k).slots.size())}, shards_[k].options().requires_grad(false));
        counters.select(0, static_cast<int64_t>(slot_index)).copy_(t.detach().reshape({}));
        continue;
      }
      TORCH_CHECK_VALUE(t.sizes() == param_sizes(k, slot_index) || slot.numel == 1, where, ": state[", i, "]['", name,
                        "'] has shape ", t.sizes(), " but its parameter has shape ", param_sizes(k, slot_index),
                        "; the state belongs to another model");
      at::Tensor& out = states[k][name];
      if (!out.defined()) out = at::zeros({s}, shards_[k].options().dtype(codes ? at::kByte : at::kFloat).requires_grad(false));
      const int64_t from = std::max(lo, slot.offset), to = std::min(lo + s, slot.offset + slot.numel);
      if (from < to) out.narrow(0, from - lo, to - from).copy_(t.detach().reshape({-1}).narrow(0, from - slot.offset, to - from));
    }
  }
  // The fields of a buffer whose parameters' states were all taken from others' shapes (zeros where absent).
  for (size_t k = 0; k < shards_.size(); ++k) {
    if (first_of[k] < 0) continue;
    for (const auto& [name, t] : per_param[first_of[k]]) {
      at::Tensor& out = states[k][name];
      const auto zeros = [&](int64_t n, at::ScalarType dtype) {
        return at::zeros({n}, shards_[k].options().dtype(dtype).requires_grad(false));
      };
      if (!out.defined())
        out = name == kStep ? zeros(static_cast<int64_t>(bucket(k).slots.size()), at::kFloat)
                            : zeros(shards_[k].numel() / per_entry(name), is_state_codes(name) ? at::kByte : at::kFloat);
    }
  }
  return states;
}

std::vector<at::Tensor> ZeroShards::take_masters(std::vector<NamedTensors>& states) const {
  TORCH_CHECK_VALUE(states.size() == shards_.size(), "ZeroOptimizer: ", states.size(), " states for ",
                    shards_.size(), " flat buffers");
  std::vector<at::Tensor> masters(shards_.size());
  for (size_t k = 0; k < shards_.size(); ++k) {
    const auto found = states[k].find(kMaster);
    if (found == states[k].end()) continue;
    const at::Tensor& m = found->second;
    TORCH_CHECK_VALUE(m.defined() && m.is_floating_point() && m.numel() == shards_[k].numel(), "ZeroOptimizer: '",
                      kMaster, "' of flat buffer ", k, " must be a floating tensor of ", shards_[k].numel(),
                      " elements, got ", m.defined() ? m.toString() : "none", " of shape ",
                      m.defined() ? c10::str(m.sizes()) : "[]");
    if (is_master(k) || stage() == 3)
      masters[k] = m.detach().reshape({-1}).to(shards_[k].options().requires_grad(false), /*non_blocking=*/false,
                                                /*copy=*/true);
    states[k].erase(found);
  }
  return masters;
}

void ZeroShards::install_loaded(const std::vector<at::Tensor>& masters, std::string id, int64_t steps) {
  wait_for_parameters();  // masters made again from the parameters read them
  c10::NoGradGuard no_grad;
  for (size_t k = 0; k < shards_.size(); ++k) {
    if (stage() == 3) {  // the shard is the parameter: a state without one leaves it as it is
      release_units();
      if (masters[k].defined()) shards_[k].copy_(masters[k]);
      if (separate_shard(k)) low_shards_[k].copy_(shards_[k]);  // rounded to nearest even (offload: to the device)
      continue;
    }
    if (separate_shard(k)) shards_[k].copy_(masters[k].defined() ? masters[k] : data_shard(k).to(at::kFloat));
    record_versions(k);
  }
  id_ = std::move(id);
  steps_ = steps;
}

std::vector<NamedTensors> ZeroShards::with_masters(std::vector<NamedTensors> states) const {
  for (size_t k = 0; k < shards_.size(); ++k)
    if (is_master(k) || stage() == 3) states[k][kMaster] = shards_[k].detach();  // stage 3: the parameters' shard
  return states;
}

}  // namespace gpuops::optim
