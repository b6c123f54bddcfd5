#include "comm/flight_recorder.h"

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <filesystem>
#include <fstream>
#include <map>
#include <mutex>
#include <nlohmann/json.hpp>
#include <set>
#include <thread>

#include "comm/mpi_env.h"
#include "util/error.h"
#include "util/strings.h"

namespace mfsdp {

FlightTag::FlightTag(const std::string& tag) { FlightRecorder::instance().set_tag(tag); }
FlightTag::~FlightTag() { FlightRecorder::instance().set_tag(""); }

namespace {
double now_s() {
  return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
}
constexpr size_t kKeep = 256;  // records kept per rank
}  // namespace

struct FlightRecorder::Impl {
  struct Entry {
    uint64_t handle;
    std::string op, group, members, dtype, tag;
    std::vector<int> member_ranks;
    uint64_t seq;
    int64_t numel, step;
    double start, end = -1;
    std::function<bool()> done;  // device collectives: polled by the watchdog
    std::function<void()> abort;
  };
  std::mutex mu;
  std::deque<Entry> entries;
  std::map<uint64_t, size_t> unused;
  uint64_t next = 1;
  int64_t step = 0;
  std::string tag;
  // watchdog
  std::thread watchdog;
  std::condition_variable cv;
  bool stop = false;
  double timeout_s = 0;
  std::string dir;
  int rank = 0, world = 1;
  std::vector<std::string> hosts;  // rank -> host name (set once the placement is known)
};

FlightRecorder& FlightRecorder::instance() {
  static FlightRecorder r;
  return r;
}

FlightRecorder::Impl* FlightRecorder::impl() {
  static Impl i;
  return &i;
}

uint64_t FlightRecorder::begin(const std::string& op, const std::string& group, const std::vector<int>& members,
                               uint64_t seq, int64_t numel, const std::string& dtype) {
  Impl* I = impl();
  std::vector<std::string> m;
  for (int r : members) m.push_back(std::to_string(r));
  std::lock_guard<std::mutex> lock(I->mu);
  Impl::Entry e{I->next++, op, group, "[" + join(m, ",") + "]", dtype, I->tag, members, seq, numel, I->step, now_s(), -1, {}, {}};
  I->entries.push_back(e);
  while (I->entries.size() > kKeep && I->entries.front().end >= 0) I->entries.pop_front();
  return e.handle;
}

void FlightRecorder::set_hosts(std::vector<std::string> hosts) {
  Impl* I = impl();
  std::lock_guard<std::mutex> lock(I->mu);
  I->hosts = std::move(hosts);
}

void FlightRecorder::end(uint64_t handle) {
  Impl* I = impl();
  std::lock_guard<std::mutex> lock(I->mu);
  for (auto it = I->entries.rbegin(); it != I->entries.rend(); ++it)
    if (it->handle == handle) {
      it->end = now_s();
      break;
    }
}

void FlightRecorder::watch(uint64_t handle, std::function<bool()> done, std::function<void()> abort) {
  Impl* I = impl();
  std::lock_guard<std::mutex> lock(I->mu);
  for (auto it = I->entries.rbegin(); it != I->entries.rend(); ++it)
    if (it->handle == handle) {
      it->done = std::move(done);
      it->abort = std::move(abort);
      break;
    }
}

void FlightRecorder::set_step(int64_t step) {
  std::lock_guard<std::mutex> lock(impl()->mu);
  impl()->step = step;
}

void FlightRecorder::set_tag(const std::string& tag) {
  std::lock_guard<std::mutex> lock(impl()->mu);
  impl()->tag = tag;
}

std::string FlightRecorder::dump(const std::string& reason) {
  Impl* I = impl();
  nlohmann::json j;
  {
    std::lock_guard<std::mutex> lock(I->mu);
    j["rank"] = I->rank;
    j["world_size"] = I->world;
    j["host"] = [] {
      char h[256] = {0};
      gethostname(h, sizeof h - 1);
      return std::string(h);
    }();
    j["pid"] = int(getpid());
    j["step"] = I->step;
    j["reason"] = reason;
    j["time"] = now_s();
    j["records"] = nlohmann::json::array();
    for (const auto& e : I->entries)
      j["records"].push_back({{"seq", e.seq},       {"op", e.op},       {"group", e.group}, {"members", e.members},
                              {"elements", e.numel}, {"dtype", e.dtype}, {"step", e.step},   {"tag", e.tag},
                              {"start", e.start},    {"end", e.end < 0 ? nlohmann::json() : nlohmann::json(e.end)}});
  }
  const std::string dir = I->dir + "/flight";
  std::filesystem::create_directories(dir);
  const std::string path = fmt::format("{}/rank_{}.json", dir, I->rank);
  std::ofstream(path + ".tmp") << j.dump(1) << "\n";
  std::rename((path + ".tmp").c_str(), path.c_str());
  return path;
}

void FlightRecorder::start_watchdog(double timeout_s, const std::string& run_dir, int rank, int world) {
  Impl* I = impl();
  {
    std::lock_guard<std::mutex> lock(I->mu);
    if (I->watchdog.joinable()) return;
    I->timeout_s = timeout_s;
    I->dir = run_dir;
    I->rank = rank;
    I->world = world;
    I->stop = false;
  }
  I->watchdog = std::thread([this, I] {
    std::unique_lock<std::mutex> lock(I->mu);
    while (!I->stop) {
      I->cv.wait_for(lock, std::chrono::milliseconds(250));
      if (I->stop) break;
      const double t = now_s();
      for (auto& e : I->entries)  // device collectives end when their completion event has fired
        if (e.end < 0 && e.done && e.done()) {
          e.end = t;
          e.done = nullptr;
          e.abort = nullptr;
        }
      const Impl::Entry* stuck = nullptr;
      for (const auto& e : I->entries)
        if (e.end < 0 && t - e.start > I->timeout_s) {
          stuck = &e;
          break;
        }
      if (!stuck) continue;
      for (auto& e : I->entries)  // hung device work fails instead of spinning on the GPU
        if (e.end < 0 && e.abort) e.abort();
      // The peers it waits for, with their hosts: a peer on another host may be unreachable (a cut
      // link, a dead node) rather than dead or out of step.
      std::string peers;
      for (int r : stuck->member_ranks) {
        if (r == I->rank) continue;
        peers += (peers.empty() ? "" : ", ") + std::to_string(r);
        if (size_t(r) < I->hosts.size()) peers += " on " + I->hosts[size_t(r)];
      }
      const std::string where = size_t(I->rank) < I->hosts.size() ? " (this rank is on " + I->hosts[size_t(I->rank)] + ")" : "";
      const std::string what = fmt::format(
          "{} #{} on group {} {} ({} elements, {}{}) has not finished after {:.0f} s (distributed.timeout_s = {:g}) "
          "at step {}; waiting for rank(s) {}{}",
          stuck->op, stuck->seq, stuck->group, stuck->members, stuck->numel, stuck->dtype,
          stuck->tag.empty() ? "" : ", " + stuck->tag, t - stuck->start, I->timeout_s, stuck->step, peers, where);
      lock.unlock();
      std::string path;
      try {
        path = dump("watchdog: " + what);
      } catch (const std::exception& e) {
        path = std::string("(could not write the flight record: ") + e.what() + ")";
      }
      std::fprintf(stderr,
                   "mfsdp: rank %d: watchdog: %s; a peer died, is unreachable or issued a different collective. "
                   "Flight record: %s (run `mfsdp diagnose %s`)\n",
                   I->rank, what.c_str(), path.c_str(), I->dir.c_str());
      std::fflush(stderr);
      // Give the other ranks' watchdogs a moment to write their records before the job ends.
      std::this_thread::sleep_for(std::chrono::seconds(2));
      // MPI_Abort has to reach the launcher; when the network to it is gone it may never return:
      // this rank ends regardless after 10 s.
      std::thread([] {
        std::this_thread::sleep_for(std::chrono::seconds(10));
        std::_Exit(3);
      }).detach();
      MpiEnv::abort_job(3);
    }
  });
}

void FlightRecorder::stop_watchdog() {
  Impl* I = impl();
  {
    std::lock_guard<std::mutex> lock(I->mu);
    I->stop = true;
  }
  I->cv.notify_all();
  if (I->watchdog.joinable()) I->watchdog.join();
}

// ------------------------------------------------------------------------------------------------
std::string diagnose_flight_records(const std::string& run_dir) {
  namespace fs = std::filesystem;
  const std::string dir = run_dir + "/flight";
  if (!fs::exists(dir)) throw UserError(dir + ": no flight records (the watchdog writes them when a collective hangs)");
  std::map<int, nlohmann::json> ranks;
  int world = 0;
  for (const auto& e : fs::directory_iterator(dir)) {
    if (e.path().extension() != ".json") continue;
    try {
      nlohmann::json j = nlohmann::json::parse(std::ifstream(e.path()));
      ranks[j["rank"].get<int>()] = j;
      world = std::max(world, j["world_size"].get<int>());
    } catch (const std::exception& ex) {
      throw UserError(e.path().string() + ": unreadable flight record: " + ex.what());
    }
  }
  if (ranks.empty()) throw UserError(dir + ": no flight records");
  std::string out = fmt::format("flight records of {} of {} ranks in {}\n", ranks.size(), world, dir);
  for (int r = 0; r < world; ++r)
    if (!ranks.count(r)) out += fmt::format("  rank {}: no record (it died, or was stopped before its watchdog fired)\n", r);
  // Per group instance (name + members): each rank's collective in flight and its last finished one.
  struct State {
    std::string op;
    uint64_t seq = 0;
    bool in_flight = false;
    int64_t step = 0;
    std::string tag;
  };
  std::map<std::string, std::map<int, State>> groups;  // "name members" -> rank -> state
  for (const auto& [r, j] : ranks) {
    for (const auto& rec : j["records"]) {
      const std::string key = rec["group"].get<std::string>() + " " + rec["members"].get<std::string>();
      State s{rec["op"], rec["seq"], rec["end"].is_null(), rec["step"], rec["tag"]};
      State& cur = groups[key][r];
      if (s.in_flight || !cur.in_flight) cur = s;  // the one in flight wins, else the latest
    }
  }
  int findings = 0;
  for (const auto& [key, members] : groups) {
    std::map<std::string, std::vector<int>> by_position;  // "op #seq (in flight|done)" -> ranks
    bool any_in_flight = false;
    for (const auto& [r, s] : members) {
      any_in_flight |= s.in_flight;
      by_position[fmt::format("{} {} #{} (step {}{})", s.in_flight ? "is in" : "last finished", s.op, s.seq, s.step,
                              s.tag.empty() ? "" : ", " + s.tag)]
          .push_back(r);
    }
    if (!any_in_flight) continue;
    if (by_position.size() == 1) {
      out += fmt::format("  group {}: ranks {} all wait in the same collective: {} (a member without a record?)\n", key,
                         fmt::join(by_position.begin()->second, ","), by_position.begin()->first);
      ++findings;
      continue;
    }
    // The smallest set of ranks that disagrees with the rest is the suspect.
    auto odd = std::min_element(by_position.begin(), by_position.end(),
                                [](const auto& a, const auto& b) { return a.second.size() < b.second.size(); });
    out += fmt::format("  group {}: rank(s) {} {}", key, fmt::join(odd->second, ","), odd->first);
    for (const auto& [pos, rs] : by_position)
      if (pos != odd->first) out += fmt::format("; rank(s) {} {}", fmt::join(rs, ","), pos);
    out += "\n";
    ++findings;
  }
  if (findings == 0) out += "  no collective was in flight in the records\n";
  for (const auto& [r, j] : ranks)
    if (j.contains("reason")) out += fmt::format("  rank {} ({} pid {}): {}\n", r, j["host"].get<std::string>(), j["pid"].get<int>(),
                                                 j["reason"].get<std::string>());
  return out;
}

}  // namespace mfsdp
