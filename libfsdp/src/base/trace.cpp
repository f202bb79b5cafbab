// Timeline tracing (see fsdp/trace.h).
//
// Each thread records into its own buffer: open spans on a private stack,
// closed ones appended to a list of fixed-size chunks whose fill counts are
// published with release stores, so flush() (any thread, under a mutex of its
// own) reads a consistent prefix while the owner keeps appending -- no lock
// on the recording path. A buffer is registered in the global list (under a
// mutex) once per thread and lives until the process ends, so the spans of
// threads that exited (communication threads joined at Runtime end) are
// still written.
#include "fsdp/trace.h"

#include <nlohmann/json.hpp>

#include <unistd.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <mutex>
#include <set>
#include <unordered_map>
#include <utility>
#include <vector>

#ifndef FSDP_VERSION_STRING
#define FSDP_VERSION_STRING "0.1.0"
#endif

namespace fsdp::trace {
namespace detail {
std::atomic<bool> g_enabled{false};
}  // namespace detail

namespace {

struct Arg {
  std::string key;
  bool is_string = false;
  int64_t number = 0;
  std::string text;
};

struct Event {
  std::string name;
  std::string category;
  int64_t start_ns = 0;
  int64_t dur_ns = 0;
  std::vector<Arg> args;
  bool counter = false;  // "ph":"C" (values in args), else a complete span "X"
};

constexpr size_t kChunkEvents = 256;
// Per thread; later spans are counted as dropped (~100 MB at most per thread).
constexpr size_t kMaxEventsPerThread = size_t{1} << 20;

struct Chunk {
  std::array<Event, kChunkEvents> events;
  std::atomic<size_t> count{0};       // published: events[0, count) are final
  std::atomic<Chunk*> next{nullptr};  // set once this chunk is full
};

struct OpenSpan {
  uint64_t token;
  Event event;
};

struct ThreadBuffer {
  explicit ThreadBuffer(int tid_) : tid(tid_), name("thread " + std::to_string(tid_)) {}
  const int tid;
  std::mutex name_mu;  // set_thread_name vs flush (rare)
  std::string name;
  Chunk head;
  std::atomic<size_t> dropped{0};
  // Owner thread only.
  Chunk* tail = &head;
  size_t recorded = 0;
  uint64_t next_seq = 1;
  std::vector<OpenSpan> open;
};

struct Registry {
  std::mutex mu;  // everything below but the flush state
  std::vector<ThreadBuffer*> buffers;
  bool started = false;
  std::string dir;
  int rank = 0;
  int world_size = 1;
  bool origin_set = false;
  int64_t origin_ns = 0;
  std::unordered_map<int64_t, std::string> unit_labels;

  std::mutex flush_mu;  // one flush at a time; guards the flush state
  bool written = false;
  size_t written_events = 0;
  std::set<std::string> warned;
};

// Never destroyed: flush() runs from atexit and spans may end during static
// destruction.
Registry& registry() {
  static Registry* r = new Registry;
  return *r;
}

// One write(2) per line, so that ranks sharing a terminal do not interleave.
void warn(const std::string& message) {
  const std::string line = "[libfsdp] FSDP_TRACE: " + message + "\n";
  if (::write(STDERR_FILENO, line.data(), line.size()) < 0) {
    // Nowhere left to report it.
  }
}

thread_local ThreadBuffer* tl_buffer = nullptr;
thread_local int64_t tl_unit = -1;
thread_local int64_t tl_bytes_hint = -1;

ThreadBuffer& buffer() {
  if (tl_buffer == nullptr) {
    Registry& r = registry();
    std::lock_guard<std::mutex> lock(r.mu);
    tl_buffer = new ThreadBuffer(static_cast<int>(r.buffers.size()));
    r.buffers.push_back(tl_buffer);
  }
  return *tl_buffer;
}

void publish(ThreadBuffer& b, Event&& e) {
  if (b.recorded >= kMaxEventsPerThread) {
    b.dropped.fetch_add(1, std::memory_order_relaxed);
    return;
  }
  Chunk* c = b.tail;
  size_t n = c->count.load(std::memory_order_relaxed);
  if (n == kChunkEvents) {
    auto* fresh = new Chunk;
    c->next.store(fresh, std::memory_order_release);
    b.tail = c = fresh;
    n = 0;
  }
  c->events[n] = std::move(e);
  c->count.store(n + 1, std::memory_order_release);
  ++b.recorded;
}

OpenSpan* find_open(uint64_t token) {
  ThreadBuffer* b = tl_buffer;
  if (b == nullptr || (token >> 40) != static_cast<uint64_t>(b->tid) + 1) return nullptr;
  for (auto it = b->open.rbegin(); it != b->open.rend(); ++it) {
    if (it->token == token) return &*it;
  }
  return nullptr;
}

void set_arg(Event& e, const char* key, bool is_string, int64_t number, std::string text) {
  for (auto& a : e.args) {
    if (a.key == key) {
      a.is_string = is_string;
      a.number = number;
      a.text = std::move(text);
      return;
    }
  }
  e.args.push_back(Arg{key, is_string, number, std::move(text)});
}

void warn_once(Registry& r, const std::string& path, const std::string& why) {
  if (!r.warned.insert(path).second) return;
  warn("cannot write trace file " + path + ": " + why);
}

constexpr auto kJsonErrors = nlohmann::json::error_handler_t::replace;

// JSON string literal. Plain ASCII (span, module and group names) is escaped
// here, fast; anything else goes through nlohmann-json, which also replaces
// invalid UTF-8.
void put_string(std::string& out, const std::string& s) {
  const bool ascii = std::all_of(s.begin(), s.end(),
                                 [](char c) { return static_cast<unsigned char>(c) < 0x80; });
  if (!ascii) {
    out += nlohmann::json(s).dump(-1, ' ', false, kJsonErrors);
    return;
  }
  out += '"';
  for (const char c : s) {
    if (c == '"' || c == '\\') {
      out += '\\';
      out += c;
    } else if (static_cast<unsigned char>(c) < 0x20) {
      char buf[8];
      std::snprintf(buf, sizeof(buf), "\\u%04x", static_cast<unsigned>(c));
      out += buf;
    } else {
      out += c;
    }
  }
  out += '"';
}

// Nanoseconds as microseconds with three decimals, exactly.
void put_micros(std::string& out, int64_t ns) {
  ns = std::max<int64_t>(0, ns);
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%lld.%03lld", static_cast<long long>(ns / 1000),
                static_cast<long long>(ns % 1000));
  out += buf;
}

void put_metadata(std::string& out, const char* name, int pid, int tid, const char* key,
                  const std::string& value, int64_t number) {
  out += ",\n{\"name\":\"";
  out += name;
  out += "\",\"ph\":\"M\",\"pid\":" + std::to_string(pid);
  if (tid >= 0) out += ",\"tid\":" + std::to_string(tid);
  out += ",\"args\":{\"";
  out += key;
  out += "\":";
  if (value.empty()) {
    out += std::to_string(number);
  } else {
    put_string(out, value);
  }
  out += "}}";
}

void write_trace(std::ostream& out, const Registry& r, const std::vector<ThreadBuffer*>& buffers,
                 const std::vector<std::vector<std::pair<const Chunk*, size_t>>>& chunks,
                 const std::vector<std::string>& names,
                 const std::unordered_map<int64_t, std::string>& labels, size_t dropped) {
  const nlohmann::json other = {{"rank", r.rank},
                                {"world_size", r.world_size},
                                {"libfsdp_version", FSDP_VERSION_STRING},
                                {"clock", "steady_clock, microseconds since the Runtime started"},
                                {"dropped_events", dropped}};
  std::string text = "{\"displayTimeUnit\":\"ms\",\"otherData\":" +
                     other.dump(-1, ' ', false, kJsonErrors) + ",\"traceEvents\":[\n";
  // Metadata first: the process (one per rank) and a name per thread.
  text += "{\"name\":\"process_name\",\"ph\":\"M\",\"pid\":" + std::to_string(r.rank) +
          ",\"args\":{\"name\":\"rank " + std::to_string(r.rank) + "\"}}";
  put_metadata(text, "process_sort_index", r.rank, -1, "sort_index", {}, r.rank);
  for (size_t i = 0; i < buffers.size(); ++i) {
    put_metadata(text, "thread_name", r.rank, buffers[i]->tid, "name", names[i], 0);
    put_metadata(text, "thread_sort_index", r.rank, buffers[i]->tid, "sort_index", {},
                 buffers[i]->tid);
  }
  const std::string pid = std::to_string(r.rank);
  for (size_t i = 0; i < buffers.size(); ++i) {
    const std::string tid = std::to_string(buffers[i]->tid);
    for (const auto& [chunk, n] : chunks[i]) {
      for (size_t k = 0; k < n; ++k) {
        const Event& e = chunk->events[k];
        text += ",\n{\"name\":";
        put_string(text, e.name);
        text += ",\"cat\":";
        put_string(text, e.category);
        text += e.counter ? ",\"ph\":\"C\",\"ts\":" : ",\"ph\":\"X\",\"ts\":";
        put_micros(text, e.start_ns - r.origin_ns);
        if (!e.counter) {
          text += ",\"dur\":";
          put_micros(text, e.dur_ns);
        }
        text += ",\"pid\":" + pid + ",\"tid\":" + tid + ",\"args\":{";
        bool first = true;
        auto key = [&](const std::string& k) {
          if (!first) text += ',';
          first = false;
          put_string(text, k);
          text += ':';
        };
        for (const auto& a : e.args) {
          key(a.key);
          if (a.is_string) {
            put_string(text, a.text);
            continue;
          }
          text += std::to_string(a.number);
          if (a.key != "unit") continue;
          auto it = labels.find(a.number);
          if (it == labels.end()) continue;
          key("unit_name");
          put_string(text, it->second);
        }
        text += "}}";
      }
      if (text.size() > (size_t{1} << 20)) {
        out << text;
        text.clear();
      }
    }
  }
  text += "\n]}\n";
  out << text;
}

void flush_impl() {
  Registry& r = registry();
  std::lock_guard<std::mutex> flush_lock(r.flush_mu);
  std::vector<ThreadBuffer*> buffers;
  std::unordered_map<int64_t, std::string> labels;
  std::string dir;
  {
    std::lock_guard<std::mutex> lock(r.mu);
    if (!r.started) return;
    buffers = r.buffers;
    labels = r.unit_labels;
    dir = r.dir;
  }
  // Snapshot what each buffer published; later spans wait for the next flush.
  std::vector<std::vector<std::pair<const Chunk*, size_t>>> chunks(buffers.size());
  std::vector<std::string> names(buffers.size());
  size_t total = 0;
  size_t dropped = 0;
  for (size_t i = 0; i < buffers.size(); ++i) {
    for (const Chunk* c = &buffers[i]->head; c != nullptr;
         c = c->next.load(std::memory_order_acquire)) {
      const size_t n = c->count.load(std::memory_order_acquire);
      chunks[i].emplace_back(c, n);
      total += n;
    }
    std::lock_guard<std::mutex> lock(buffers[i]->name_mu);
    names[i] = buffers[i]->name;
    dropped += buffers[i]->dropped.load(std::memory_order_relaxed);
  }
  if (r.written && total == r.written_events) return;  // nothing new since the last flush

  namespace fs = std::filesystem;
  const fs::path path = fs::path(dir) / ("fsdp-trace-rank" + std::to_string(r.rank) + ".json");
  const fs::path tmp = fs::path(path).concat(".tmp");
  std::error_code ec;
  fs::create_directories(dir, ec);
  {
    std::ofstream out(tmp, std::ios::binary | std::ios::trunc);
    if (!out) {
      warn_once(r, path.string(), ec ? ec.message() : "cannot open " + tmp.string());
      return;
    }
    write_trace(out, r, buffers, chunks, names, labels, dropped);
    out.close();
    if (!out) {
      warn_once(r, path.string(), "write error");
      fs::remove(tmp, ec);
      return;
    }
  }
  fs::rename(tmp, path, ec);  // readers never see a partial file
  if (ec) {
    warn_once(r, path.string(), ec.message());
    return;
  }
  if (dropped > 0 && !r.written) {
    warn(std::to_string(dropped) + " span(s) dropped on rank " + std::to_string(r.rank) +
         " (more than " + std::to_string(kMaxEventsPerThread) + " on one thread)");
  }
  r.written = true;
  r.written_events = total;
}

void flush_at_exit() { flush(); }

}  // namespace

namespace detail {

int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

uint64_t begin(std::string name, const char* category) {
  ThreadBuffer& b = buffer();
  const uint64_t token = ((static_cast<uint64_t>(b.tid) + 1) << 40) |
                         (b.next_seq++ & ((uint64_t{1} << 40) - 1));
  OpenSpan span{token, Event{}};
  span.event.name = std::move(name);
  span.event.category = category != nullptr ? category : "user";
  if (tl_unit >= 0) span.event.args.push_back(Arg{"unit", false, tl_unit, {}});
  b.open.push_back(std::move(span));
  b.open.back().event.start_ns = now_ns();
  return token;
}

void end(uint64_t token) {
  const int64_t now = now_ns();
  if (find_open(token) == nullptr) return;
  ThreadBuffer& b = *tl_buffer;
  // Spans begun after this one and still open end with it, so the thread's
  // spans always nest; they are marked.
  for (;;) {
    OpenSpan top = std::move(b.open.back());
    b.open.pop_back();
    top.event.dur_ns = now - top.event.start_ns;
    const bool done = top.token == token;
    if (!done) set_arg(top.event, "closed_by_outer_span", false, 1, {});
    publish(b, std::move(top.event));
    if (done) return;
  }
}

void counter(std::string name, const char* category,
             const std::vector<std::pair<std::string, int64_t>>& values) {
  if (!g_enabled.load(std::memory_order_relaxed)) return;
  ThreadBuffer& b = buffer();
  Event e;
  e.name = std::move(name);
  e.category = category != nullptr ? category : "user";
  e.start_ns = now_ns();
  e.counter = true;
  for (const auto& [key, value] : values) e.args.push_back(Arg{key, false, value, {}});
  publish(b, std::move(e));
}

void add_arg(uint64_t token, const char* key, int64_t value) {
  if (OpenSpan* s = find_open(token)) set_arg(s->event, key, false, value, {});
}

void add_arg(uint64_t token, const char* key, std::string value) {
  if (OpenSpan* s = find_open(token)) set_arg(s->event, key, true, 0, std::move(value));
}

void start(int rank, int world_size) {
  const char* env = std::getenv("FSDP_TRACE");
  if (env == nullptr || *env == '\0') return;
  std::error_code ec;
  std::filesystem::create_directories(env, ec);
  if (ec || ::access(env, W_OK | X_OK) != 0) {
    warn("cannot create or write directory " + std::string(env) + " (" +
         (ec ? ec.message() : std::string("not writable")) + "); tracing is off on rank " +
         std::to_string(rank));
    return;
  }
  Registry& r = registry();
  {
    std::lock_guard<std::mutex> lock(r.mu);
    r.dir = env;
    r.rank = rank;
    r.world_size = world_size;
    if (!r.origin_set) {
      r.origin_ns = now_ns();
      r.origin_set = true;
    }
    r.started = true;
  }
  set_thread_name("main");
  static std::once_flag at_exit;
  std::call_once(at_exit, [] { std::atexit(flush_at_exit); });
  g_enabled.store(true, std::memory_order_release);
}

void stop() {
  if (!g_enabled.exchange(false)) return;
  flush();
}

int64_t swap_unit(int64_t unit) { return std::exchange(tl_unit, unit); }

int64_t current_unit() { return tl_unit; }

void set_unit_label(int64_t unit, std::string label) {
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mu);
  r.unit_labels[unit] = std::move(label);
}

std::string unit_label(int64_t unit) {
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mu);
  auto it = r.unit_labels.find(unit);
  return it == r.unit_labels.end() ? std::string() : it->second;
}

void hint_collective_bytes(int64_t bytes) { tl_bytes_hint = bytes; }

int64_t take_collective_bytes() { return std::exchange(tl_bytes_hint, -1); }

}  // namespace detail

void set_thread_name(std::string name) {
  ThreadBuffer& b = buffer();
  std::lock_guard<std::mutex> lock(b.name_mu);
  b.name = std::move(name);
}

void flush() {
  try {
    flush_impl();
  } catch (const std::exception& e) {
    warn(std::string("writing the trace failed: ") + e.what());
  } catch (...) {
    warn("writing the trace failed");
  }
}

std::string file_path() {
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mu);
  if (!r.started) return {};
  return (std::filesystem::path(r.dir) / ("fsdp-trace-rank" + std::to_string(r.rank) + ".json"))
      .string();
}

}  // namespace fsdp::trace
