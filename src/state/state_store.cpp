// gpuops::StateStore (state_store.h): the one file protocol of training states. JSON in nlohmann-json,
// files on POSIX calls (posix_files.h).
#include "gpuops/state_store.h"

#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <charconv>
#include <cstdio>
#include <cstring>
#include <map>
#include <optional>
#include <regex>
#include <set>

#include <c10/util/Exception.h>
#include <nlohmann/json.hpp>

#include "../common/file_checks.h"
#include "gpuops/telemetry.h"
#include "posix_files.h"

using json = nlohmann::json;

namespace gpuops {
namespace {

double steady_seconds() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

constexpr int kFormat = 2;
constexpr const char* kChecksums = "checksums.json";
constexpr const char* kManifest = "manifest.json";
constexpr int64_t kMaxIndexBytes = 64 << 20;  // a manifest or checksums file past this is not ours

// A state folder: state-<step> or state-<step>.<sequence>; a legacy state file: state-<step>.pt.
const std::regex& folder_name() {
  static const std::regex pattern(R"(state-(\d{1,18})(?:\.(\d{1,9}))?)");
  return pattern;
}
const std::regex& legacy_name() {
  static const std::regex pattern(R"(state-(\d{1,18})\.pt)");
  return pattern;
}
// A file inside a state folder: a plain name, no path, not hidden.
bool plain_file_name(const std::string& name) {
  static const std::regex pattern(R"([A-Za-z0-9_][A-Za-z0-9_.\-]{0,127})");
  return std::regex_match(name, pattern) && name != kChecksums;
}
bool sha256_hex(const std::string& text) {
  static const std::regex pattern(R"([0-9a-f]{64})");
  return std::regex_match(text, pattern);
}

int64_t to_int(const std::string& digits) {
  int64_t value = 0;
  std::from_chars(digits.data(), digits.data() + digits.size(), value);  // <= 18 digits: fits
  return value;
}

std::string folder_state_name(int64_t step, int64_t sequence) {
  char name[48];
  if (sequence == 0)
    std::snprintf(name, sizeof name, "state-%012lld", static_cast<long long>(step));
  else
    std::snprintf(name, sizeof name, "state-%012lld.%lld", static_cast<long long>(step), static_cast<long long>(sequence));
  return name;
}

// A state named `name` (no files yet), or nothing when the name is not a state's.
std::optional<StoredState> state_named(const std::string& directory, const std::string& name) {
  std::smatch m;
  StoredState state;
  if (std::regex_match(name, m, legacy_name())) {
    state.legacy = true;
    state.sequence = -1;  // before any re-save of the same step in the folder format
  } else if (std::regex_match(name, m, folder_name())) {
    state.sequence = m[2].matched ? to_int(m[2]) : 0;
  } else {
    return std::nullopt;
  }
  state.step = to_int(m[1]);
  state.name = name;
  state.path = detail::join_path(directory, name);
  return state;
}

bool newer(const StoredState& a, const StoredState& b) {
  return a.step != b.step ? a.step > b.step : a.sequence > b.sequence;
}

// nlohmann's typed getters throw its own exceptions; these name what is wrong instead.
int64_t json_int(const json& object, const char* key, int64_t low) {
  const auto it = object.find(key);
  if (it == object.end() || !it->is_number_integer() || it->get<int64_t>() < low)
    throw std::runtime_error(std::string("'") + key + "' is not an integer >= " + std::to_string(low));
  return it->get<int64_t>();
}
std::string json_string(const json& object, const char* key) {
  const auto it = object.find(key);
  if (it == object.end() || !it->is_string()) throw std::runtime_error(std::string("'") + key + "' is not a string");
  return it->get<std::string>();
}

std::vector<StoredFile> parse_files(const json& list) {
  if (!list.is_array() || list.empty()) throw std::runtime_error("'files' is not a non-empty list");
  std::vector<StoredFile> files;
  std::set<std::string> names;
  for (const json& item : list) {
    if (!item.is_object()) throw std::runtime_error("a file entry is not an object");
    StoredFile file{json_string(item, "name"), json_int(item, "bytes", 0), json_string(item, "sha256")};
    if (!plain_file_name(file.name) || !names.insert(file.name).second)
      throw std::runtime_error("file name '" + file.name + "' is not a plain, distinct file name");
    if (!sha256_hex(file.sha256)) throw std::runtime_error("'sha256' of " + file.name + " is not 64 hex digits");
    files.push_back(std::move(file));
  }
  return files;
}

json files_json(const std::vector<StoredFile>& files) {
  json list = json::array();
  for (const auto& f : files) list.push_back({{"name", f.name}, {"bytes", f.bytes}, {"sha256", f.sha256}});
  return list;
}

// One manifest entry: a folder state ({"name", "step", "sequence", "writer", "files"}) or a legacy one
// ({"file", "bytes", "sha256", "step"}). Names are confined to state names in the store.
StoredState parse_entry(const std::string& directory, const json& entry) {
  if (!entry.is_object()) throw std::runtime_error("an entry is not an object");
  const bool legacy = entry.contains("file");
  const std::string name = json_string(entry, legacy ? "file" : "name");
  auto state = state_named(directory, name);
  if (!state || state->legacy != legacy) throw std::runtime_error("'" + name + "' is not the name of a state in the folder");
  if (json_int(entry, "step", 0) != state->step) throw std::runtime_error("the step of " + name + " differs from its name");
  if (legacy) {
    StoredFile file{name, json_int(entry, "bytes", 0), json_string(entry, "sha256")};
    if (!sha256_hex(file.sha256)) throw std::runtime_error("'sha256' of " + name + " is not 64 hex digits");
    state->files = {file};
  } else {
    state->writer = json_string(entry, "writer");
    state->files = parse_files(entry.at("files"));
  }
  return *state;
}

json entry_json(const StoredState& s) {
  if (s.legacy) return {{"file", s.name}, {"bytes", s.files.at(0).bytes}, {"sha256", s.files.at(0).sha256}, {"step", s.step}};
  return {{"name", s.name}, {"step", s.step}, {"sequence", s.sequence}, {"writer", s.writer}, {"files", files_json(s.files)}};
}

// The manifest's entries; std::nullopt (and a warning) when it is missing or unreadable.
std::optional<std::vector<StoredState>> read_manifest(const std::string& directory, std::vector<std::string>& warnings) {
  const std::string path = detail::join_path(directory, kManifest);
  if (!detail::path_kind(path).exists) return std::nullopt;
  try {
    const json manifest = json::parse(detail::read_small_file(path, kMaxIndexBytes));
    if (!manifest.is_object() || !manifest.contains("states") || !manifest["states"].is_array())
      throw std::runtime_error("it has no list 'states'");
    std::vector<StoredState> states;
    for (const json& entry : manifest["states"]) {
      try {
        states.push_back(parse_entry(directory, entry));
      } catch (const std::exception& e) {
        warnings.push_back(path + " has an entry that is ignored (" + e.what() + ")");
      }
    }
    return states;
  } catch (const std::exception& e) {
    const std::string what = e.what();
    warnings.push_back(path + " is unreadable (" + what.substr(0, what.find('\n')) + "); scanning " + directory);
    return std::nullopt;
  }
}

// What a state folder's checksums.json says, checked against the folder's name.
void read_checksums(StoredState& state) {
  const json sums = json::parse(detail::read_small_file(detail::join_path(state.path, kChecksums), kMaxIndexBytes));
  if (!sums.is_object()) throw std::runtime_error("checksums.json is not an object");
  if (json_int(sums, "format", 0) != kFormat) throw std::runtime_error("checksums.json has an unknown format");
  if (json_int(sums, "step", 0) != state.step) throw std::runtime_error("checksums.json names another step");
  const std::string writer = json_string(sums, "writer");
  auto files = parse_files(sums.at("files"));
  const bool listed = !state.files.empty();
  if (listed && (writer != state.writer || files_json(files) != files_json(state.files)))
    throw std::runtime_error("its checksums.json differs from the manifest's entry");
  state.writer = writer;
  state.files = std::move(files);
}

std::string check_file(const std::string& path, const StoredFile& file, bool hash) {
  const auto kind = detail::path_kind(path);
  if (!kind.exists) return path + " is missing";
  if (!kind.regular) return path + " is not a regular file";
  if (file.bytes >= 0 && kind.bytes != file.bytes)
    return path + " has " + std::to_string(kind.bytes) + " bytes, the checksums say " + std::to_string(file.bytes) +
           " (truncated?)";
  if (hash && !file.sha256.empty() && detail::sha256_of_file(path) != file.sha256)
    return path + " does not match its SHA-256 checksum (corrupt)";
  return "";
}

// verify() without hashing the files of a state the manifest vouches for (keep-K runs it at every save).
std::string quick_check(const StateStore& store, StoredState& state, bool listed) {
  if (!listed) return store.verify(state);
  if (!state.legacy) {
    const auto kind = detail::path_kind(state.path);
    if (!kind.folder) return state.path + (kind.exists ? " is not a folder" : " is missing");
  }
  for (const auto& f : state.files)
    if (auto problem = check_file(state.file_path(f.name), f, false); !problem.empty()) return problem;
  return "";
}

bool temporary(const std::string& name) {
  return name.rfind(".tmp-", 0) == 0 || (name.rfind('.', 0) == 0 && name.find(".tmp-") != std::string::npos);
}

void remove_path(const std::string& path) {
  const auto kind = detail::path_kind(path);
  if (kind.folder)
    detail::remove_folder(path);
  else if (kind.exists)
    detail::remove_file(path);
}

std::string hidden_name(const std::string& what) { return ".tmp-" + detail::temporary_tag() + "-" + what; }

// Another host's temporaries (a shared filesystem) are removed once untouched this long: a save in progress
// there writes into its folder far more often.
constexpr int64_t kForeignTemporaryAge_s = 24 * 3600;

void emit(const std::vector<std::string>& messages, std::vector<std::string>* sink) {
  for (const auto& m : messages) {
    if (sink)
      sink->push_back(m);
    else
      TORCH_WARN("StateStore: ", m);
  }
}

}  // namespace

std::string StoredState::file_path(const std::string& file) const {
  return legacy ? path : detail::join_path(path, file);
}

std::string PendingState::file_path(const std::string& file) const {
  TORCH_CHECK_VALUE(std::find(files.begin(), files.end(), file) != files.end(), "PendingState: '", file,
                    "' is not one of the files this save declared");
  return detail::join_path(folder, file);
}

StateStore::StateStore(std::string directory, int64_t keep) : directory_(std::move(directory)), keep_(keep) {
  TORCH_CHECK_VALUE(!directory_.empty(), "StateStore: directory must not be empty");
  TORCH_CHECK_VALUE(detail::path_problem(directory_).empty(), "StateStore: directory '",
                    directory_.substr(0, directory_.find('\0')), "\\0...' holds a NUL byte (C would use another "
                    "folder)");
  TORCH_CHECK_VALUE(keep_ >= 1, "StateStore: keep must be >= 1, got ", keep_);
  detail::make_directories(directory_);
}

PendingState StateStore::begin(int64_t step, const std::vector<std::string>& files, const std::string& writer) const {
  TORCH_CHECK_VALUE(step >= 0 && step < 1000000000000000000LL, "StateStore: step must be in [0, 1e18), got ", step);
  TORCH_CHECK_VALUE(!files.empty(), "StateStore: a state needs at least one file");
  for (const auto& f : files) {
    TORCH_CHECK_VALUE(plain_file_name(f), "StateStore: file name '", f,
                      "' must be a plain name of letters, digits, '_', '.', '-' (not checksums.json)");
    TORCH_CHECK_VALUE(std::count(files.begin(), files.end(), f) == 1, "StateStore: file name '", f, "' appears twice");
  }
  TORCH_CHECK_VALUE(plain_file_name(writer), "StateStore: writer '", writer, "' must be a plain name");
  PendingState pending{step, writer, detail::join_path(directory_, hidden_name("state-" + std::to_string(step))), files,
                       steady_seconds()};
  TORCH_CHECK(::mkdir(pending.folder.c_str(), 0777) == 0, "StateStore: cannot create ", pending.folder, ": ",
              std::strerror(errno));
  return pending;
}

bool StateStore::owns(const PendingState& pending) const {
  // A folder begin() made: `.tmp-...` right inside this store (a PendingState is a plain struct: anything can be
  // put in it), and plain file names.
  const std::string prefix = detail::join_path(directory_, ".tmp-");
  return pending.folder.size() > prefix.size() && pending.folder.rfind(prefix, 0) == 0 &&
         plain_file_name(pending.folder.substr(prefix.size())) &&
         std::all_of(pending.files.begin(), pending.files.end(), [](const std::string& f) { return plain_file_name(f); });
}

void StateStore::abort(const PendingState& pending) const noexcept {
  try {
    if (!pending.folder.empty() && owns(pending)) detail::remove_folder(pending.folder);
  } catch (...) {  // best effort: the next save removes stale temporaries
  }
}

StoredState StateStore::commit(const PendingState& pending, std::vector<std::string>* warnings_out) const {
  TORCH_CHECK_VALUE(owns(pending), "StateStore: ", pending.folder, " is not a pending save of ", directory_,
                    " (begin() makes them: ", detail::join_path(directory_, ".tmp-..."), ", with plain file names); "
                    "nothing was committed");
  StoredState state;
  try {
    TORCH_CHECK(detail::path_kind(pending.folder).folder, "StateStore: the pending save ", pending.folder, " is gone");
    std::vector<StoredFile> files;
    for (const auto& name : pending.files) {
      const std::string path = detail::join_path(pending.folder, name);
      TORCH_CHECK(detail::path_kind(path).regular, "StateStore: the save declared ", name, " but did not write ", path);
      detail::fsync_path(path);
      files.push_back({name, detail::path_kind(path).bytes, detail::sha256_of_file(path)});
    }
    const json sums = {{"format", kFormat}, {"step", pending.step}, {"writer", pending.writer}, {"files", files_json(files)}};
    detail::write_atomically(detail::join_path(pending.folder, kChecksums), sums.dump(1));
    int64_t sequence = 0;  // after every state of this step in the folder, listed or not
    for (const auto& s : states())
      if (s.step == pending.step) sequence = std::max(sequence, s.sequence + 1);
    state = *state_named(directory_, folder_state_name(pending.step, sequence));
    state.writer = pending.writer;
    state.files = std::move(files);
    detail::commit_file(pending.folder, state.path);  // the state appears, complete
  } catch (...) {
    abort(pending);
    throw;
  }
  int64_t bytes = 0;  // the save, for the telemetry's checkpoint figures
  for (const auto& f : state.files) bytes += f.bytes;
  telemetry::note_checkpoint_saved(steady_seconds() - pending.started_s, bytes);

  // The state is durable; now the index and keep-K. A failure here loses nothing (load scans the folder).
  try {
    std::vector<std::string> warnings;
    const auto listed = read_manifest(directory_, warnings);
    std::set<std::string> in_manifest;
    for (const auto& s : listed.value_or(std::vector<StoredState>{})) in_manifest.insert(s.name);
    std::vector<StoredState> kept{state}, dropped;
    for (auto& s : states()) {
      if (s.name == state.name) continue;
      const bool is_listed = in_manifest.count(s.name) > 0;
      if (static_cast<int64_t>(kept.size()) < keep_) {
        const std::string problem = quick_check(*this, s, is_listed);
        if (problem.empty()) {
          // A legacy file found without a manifest has no checksum to list: it stays on disk, unlisted.
          if (!s.legacy || !s.files.empty()) kept.push_back(s);
          continue;
        }
        warnings.push_back("removing " + s.path + ": " + problem);
      }
      dropped.push_back(s);
    }
    std::sort(kept.begin(), kept.end(), [](const auto& a, const auto& b) { return newer(b, a); });  // oldest first
    json entries = json::array();
    for (const auto& s : kept) entries.push_back(entry_json(s));
    detail::write_atomically(detail::join_path(directory_, kManifest), json{{"format", kFormat}, {"states", entries}}.dump(1));
    detail::write_atomically(detail::join_path(directory_, "LATEST"), kept.back().name + "\n");
    for (const auto& s : dropped) {
      // Out of sight in one rename, then removed: a kill half-way leaves a temporary, not a broken state.
      const std::string doomed = detail::join_path(directory_, hidden_name("removing-" + s.name));
      if (::rename(s.path.c_str(), doomed.c_str()) == 0) remove_path(doomed);
    }
    for (const auto& name : detail::list_folder(directory_))
      if (temporary(name) && detail::temporary_is_stale(detail::join_path(directory_, name), name,
                                                        kForeignTemporaryAge_s))
        remove_path(detail::join_path(directory_, name));  // another writer's save in progress stays
    emit(warnings, warnings_out);
  } catch (const std::exception& e) {
    TORCH_CHECK(false, "StateStore: the state ", state.path, " is saved, but updating ", directory_,
                "'s manifest failed: ", std::string(e.what()).substr(0, std::string(e.what()).find('\n')));
  }
  return state;
}

std::vector<StoredState> StateStore::states(std::vector<std::string>* warnings) const {
  std::vector<std::string> messages;
  std::map<std::string, StoredState> found;
  if (auto listed = read_manifest(directory_, messages))
    for (auto& s : *listed) found.emplace(s.name, std::move(s));
  for (const auto& name : detail::list_folder(directory_)) {
    if (found.count(name)) continue;
    auto s = state_named(directory_, name);
    const auto kind = detail::path_kind(detail::join_path(directory_, name));
    if (s && (s->legacy ? kind.regular : kind.folder)) found.emplace(name, std::move(*s));
  }
  emit(messages, warnings);
  std::vector<StoredState> states;
  for (auto& [name, s] : found) states.push_back(std::move(s));
  std::sort(states.begin(), states.end(), newer);
  return states;
}

std::string StateStore::verify(StoredState& state, bool* unverified) const {
  if (unverified) *unverified = false;
  try {
    if (state.legacy) {
      if (state.files.empty()) {  // found by scanning: no checksum anywhere
        if (unverified) *unverified = true;
        const auto kind = detail::path_kind(state.path);
        return kind.regular ? "" : state.path + (kind.exists ? " is not a regular file" : " is missing");
      }
      return check_file(state.path, state.files.at(0), true);
    }
    const auto kind = detail::path_kind(state.path);
    if (!kind.folder) return state.path + (kind.exists ? " is not a folder" : " is missing");
    try {
      read_checksums(state);
    } catch (const std::exception& e) {
      const std::string what = e.what();
      return state.path + ": " + what.substr(0, what.find('\n'));
    }
    for (const auto& f : state.files)
      if (auto problem = check_file(state.file_path(f.name), f, true); !problem.empty()) return problem;
    return "";
  } catch (const std::exception& e) {  // an I/O error while hashing
    const std::string what = e.what();
    return state.path + " cannot be checked (" + what.substr(0, what.find('\n')) + ")";
  }
}

}  // namespace gpuops
