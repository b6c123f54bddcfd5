// YAML -> Config: strict typed reading with file:line:col in every error, overrides typed by the
// schema, cross-field validation, and Config -> YAML.
#include "config/config.h"

#include <yaml-cpp/yaml.h>

#include <cerrno>
#include <cstring>

#include <cerrno>
#include <cmath>
#include <cstdlib>
#include <regex>
#include <fstream>
#include <set>
#include <sstream>

#include "config/schema.h"
#include "util/error.h"
#include "util/strings.h"

namespace mfsdp {

const char* to_string(ZeroDpStrategy s) {
  switch (s) {
    case ZeroDpStrategy::kNoShard: return "no_shard";
    case ZeroDpStrategy::kOptim: return "optim";
    case ZeroDpStrategy::kOptimGrads: return "optim_grads";
    case ZeroDpStrategy::kOptimGradsParams: return "optim_grads_params";
  }
  return "?";
}

std::string parse_tp_style(const std::string& text, TpStyle& out) {
  static const char* kinds[] = {"colwise", "rowwise", "colwise_rep", "rowwise_rep", "vocab_parallel", "sequence_parallel", "replicate",
                                "replicated_with_grad_allreduce", "sequence_gathered", "sequence_parallel_gather",
                                "sequence_whole", "moe_experts"};
  const std::string expected =
      "a style: colwise, colwise:N or colwise:A+B+C (packed parts), rowwise, colwise_rep, rowwise_rep, vocab_parallel, "
      "sequence_parallel, sequence_parallel_gather, sequence_gathered, sequence_whole, moe_experts, replicate or "
      "replicated_with_grad_allreduce (Hugging Face's colwise_gather_output, rowwise_split_input and "
      "embedding_rowwise are colwise_rep, rowwise_rep and vocab_parallel)";
  auto colon = text.find(':');
  out = TpStyle{text.substr(0, colon), {}};
  // Hugging Face's names for the same styles (a base_model_tp_plan copied into the YAML):
  // colwise_gather_output gathers the output (colwise_rep), rowwise_split_input slices a
  // replicated input (rowwise_rep), embedding_rowwise splits an embedding's rows (the vocabulary).
  static const std::pair<const char*, const char*> hf_names[] = {
      {"colwise_gather_output", "colwise_rep"}, {"rowwise_split_input", "rowwise_rep"}, {"embedding_rowwise", "vocab_parallel"}};
  for (const auto& [hf, ours] : hf_names)
    if (out.kind == hf) out.kind = ours;
  bool known = false;
  for (const char* k : kinds) known = known || out.kind == k;
  if (!known) return expected;
  if (colon == std::string::npos) return "";
  if (out.kind != "colwise") return expected + " (only colwise takes packed parts)";
  for (const auto& part : split(text.substr(colon + 1), '+')) {
    char* end = nullptr;
    long long v = std::strtoll(part.c_str(), &end, 10);
    if (part.empty() || *end || v < 1) return expected + " (parts must be positive integers)";
    out.parts.push_back(v);
  }
  if (out.parts.size() == 1 && out.parts[0] == 1) out.parts.clear();
  return "";
}

std::string Config::where(const std::string& key) const {
  auto it = locations.find(key);
  if (it != locations.end()) return it->second;
  return source;
}

namespace schema {

Check<std::string> one_of(std::vector<std::string> choices) {
  return [choices](const std::string& v) {
    for (const auto& c : choices)
      if (v == c) return std::string();
    return "one of " + join(choices, ", ");
  };
}

std::string init_rules_check(const std::vector<std::string>& rules) {
  for (const auto& r : rules) {
    auto eq = r.find('=');
    bool ok = eq != std::string::npos && eq > 0;
    if (ok) {
      std::string spec = r.substr(eq + 1);
      char* end = nullptr;
      if (spec == "zeros" || spec == "ones") {
      } else if (spec.rfind("normal:", 0) == 0 || spec.rfind("uniform:", 0) == 0) {
        const char* num = spec.c_str() + spec.find(':') + 1;
        double x = std::strtod(num, &end);
        ok = end != num && *end == 0 && x >= 0;
      } else {
        ok = false;
      }
    }
    if (!ok) return "rules such as \"*.bias=zeros\", \"*norm*=ones\", \"*.c_proj.weight=normal:0.0025\" or \"*=uniform:0.1\" (bad: '" + r + "')";
  }
  return "";
}

std::string rename_rules_check(const std::vector<std::string>& rules) {
  for (const auto& r : rules) {
    auto eq = r.find('=');
    std::string why;
    if (eq == std::string::npos || eq == 0) {
      why = "no '='";
    } else {
      try {
        std::regex re(r.substr(0, eq));
      } catch (const std::regex_error& e) {
        why = std::string("the pattern is no regular expression: ") + e.what();
      }
    }
    if (!why.empty())
      return "rules \"REGEX=REPLACEMENT\" such as \"^transformer\\.=model.\" or \"\\.rotary_emb\\.inv_freq$=\" (drops) "
             "(bad: '" + r + "': " + why + ")";
  }
  return "";
}


Check<std::string> non_empty() {
  return [](const std::string& v) { return v.empty() ? std::string("a non-empty string") : std::string(); };
}

namespace {
struct KeyLister {
  std::vector<std::string> prefix, keys;
  template <class F>
  void section(const char* key, F&& body) {
    keys.push_back(join(prefix, ".").empty() ? key : join(prefix, ".") + "." + key);
    prefix.push_back(key);
    body();
    prefix.pop_back();
  }
  template <class T, class... C>
  void field(const char* key, const T&, C&&...) {
    keys.push_back(prefix.empty() ? std::string(key) : join(prefix, ".") + "." + key);
  }
};
}  // namespace

std::vector<std::string> all_keys() {
  Config scratch;
  KeyLister lister;
  describe(scratch, lister);
  return lister.keys;
}

}  // namespace schema

namespace {

// ---------------------------------------------------------------------------------------------
// Where a node came from. Overrides replace whole subtrees, so any path under an overridden key
// is reported as that override (the marks of nodes parsed from an override string are useless).
struct Origins {
  std::string file;
  std::vector<std::pair<std::string, std::string>> overrides;  // dotted key -> "k=v" text

  std::string of(const YAML::Node& node, const std::string& path) const {
    for (auto it = overrides.rbegin(); it != overrides.rend(); ++it) {
      const auto& k = it->first;
      if (path == k || (path.size() > k.size() && path.compare(0, k.size(), k) == 0 &&
                        (path[k.size()] == '.' || path[k.size()] == '['))) {
        return "command-line override '" + it->second + "'";
      }
    }
    if (node.IsDefined() && !node.Mark().is_null())
      return file + ":" + std::to_string(node.Mark().line + 1) + ":" + std::to_string(node.Mark().column + 1);
    return file;
  }
};

std::string describe_node(const YAML::Node& n) {
  if (!n.IsDefined() || n.IsNull()) return "null";
  if (n.IsMap()) return "a mapping";
  if (n.IsSequence()) return "a list";
  std::string s = n.Scalar();
  if (s.size() > 40) s = s.substr(0, 37) + "...";
  return "'" + s + "'";
}

bool quoted(const YAML::Node& n) { return n.Tag() == "!"; }

class Reader {
 public:
  Reader(const Origins& origins, YAML::Node root, std::map<std::string, std::string>& locations)
      : origins_(origins), locations_(locations) {
    stack_.push_back({root, ""});
  }

  [[noreturn]] void fail(const YAML::Node& n, const std::string& path, const std::string& msg) const {
    throw ConfigError(origins_.of(n, path) + ": " + path + ": " + msg);
  }

  template <class F>
  void section(const char* key, F&& body) {
    Frame& parent = stack_.back();
    std::string path = join_path(parent.path, key);
    YAML::Node node = parent.node.IsMap() ? parent.node[key] : YAML::Node();
    parent.seen.insert(key);
    if (node.IsDefined() && !node.IsNull() && !node.IsMap())
      fail(node, path, "expected a mapping (section '" + std::string(key) + ":'), got " + describe_node(node));
    if (node.IsDefined()) locations_[path] = origins_.of(node, path);
    stack_.push_back({node, path});
    body();
    check_unknown(stack_.back());
    stack_.pop_back();
  }

  template <class T>
  void field(const char* key, T& out, const schema::Check<T>& check = {}) {
    YAML::Node node;
    std::string path;
    if (!lookup(key, node, path)) return;
    convert(node, path, out);
    run_check(node, path, out, check);
  }

  template <class T>
  void field(const char* key, std::optional<T>& out, const schema::Check<T>& check = {}) {
    YAML::Node node;
    std::string path;
    if (!lookup(key, node, path)) return;
    if (node.IsNull()) {
      out.reset();
      return;
    }
    T value{};
    convert(node, path, value);
    run_check(node, path, value, check);
    out = value;
  }

  void field(const char* key, schema::IntOrAuto out, const schema::Check<int64_t>& check) {
    YAML::Node node;
    std::string path;
    if (!lookup(key, node, path)) return;
    if (node.IsNull() || (node.IsScalar() && node.Scalar() == "auto")) {
      out.value->reset();
      return;
    }
    int64_t v = 0;
    if (!node.IsScalar() || quoted(node) || !parse_int(node.Scalar(), v))
      fail(node, path, "expected an integer or 'auto', got " + describe_node(node));
    run_check(node, path, v, check);
    *out.value = v;
  }

  void finish() { check_unknown(stack_.back()); }

 private:
  struct Frame {
    YAML::Node node;
    std::string path;
    std::set<std::string> seen;
  };

  static std::string join_path(const std::string& a, const std::string& b) {
    return a.empty() ? b : a + "." + b;
  }

  bool lookup(const char* key, YAML::Node& node, std::string& path) {
    Frame& f = stack_.back();
    path = join_path(f.path, key);
    f.seen.insert(key);
    if (!f.node.IsMap()) return false;
    node = f.node[key];
    if (!node.IsDefined()) return false;
    locations_[path] = origins_.of(node, path);
    return true;
  }

  template <class T>
  void run_check(const YAML::Node& n, const std::string& path, const T& v, const schema::Check<T>& check) {
    if (!check) return;
    std::string expected = check(v);
    if (!expected.empty()) fail(n, path, "expected " + expected + ", got " + describe_node(n));
  }

  // Unknown and duplicate keys of one mapping. Suggestions come from this section first and then
  // from every section ("max_steps belongs under training:").
  void check_unknown(const Frame& f) {
    if (!f.node.IsMap()) return;
    std::set<std::string> keys_here;
    for (auto it = f.node.begin(); it != f.node.end(); ++it) {
      // A copy: yaml-cpp's iterator hands out a temporary proxy, so a reference to it->first dangles
      // (AddressSanitizer found it: stack-use-after-scope on every config with a key).
      const YAML::Node k = it->first;
      std::string name = k.IsScalar() ? k.Scalar() : std::string();
      std::string path = join_path(f.path, name);
      if (!keys_here.insert(name).second)
        fail(k, path, "duplicate key '" + name + "' (YAML keeps only one of them; remove the other)");
      if (f.seen.count(name)) continue;
      std::vector<std::string> local(f.seen.begin(), f.seen.end());
      std::string hint = closest_match(name, local);
      std::string msg = "unknown key '" + name + "'" + (f.path.empty() ? "" : " in section '" + f.path + "'");
      if (!hint.empty()) {
        msg += " (did you mean '" + hint + "'?)";
      } else {
        std::vector<std::string> everywhere = schema::all_keys();
        for (const auto& full : everywhere) {
          auto dot = full.rfind('.');
          std::string last = dot == std::string::npos ? full : full.substr(dot + 1);
          if (last == name) {
            hint = full;
            break;
          }
        }
        if (!hint.empty()) msg += " ('" + name + "' belongs at '" + hint + "')";
        else msg += "; known keys here: " + join(local, ", ");
      }
      fail(k, path, msg);
    }
  }

  static bool parse_int(const std::string& s, int64_t& v) {
    if (s.empty()) return false;
    errno = 0;
    char* end = nullptr;
    long long x = std::strtoll(s.c_str(), &end, 10);
    if (errno || *end) return false;
    v = x;
    return true;
  }
  static bool parse_double(const std::string& s, double& v) {
    if (s.empty()) return false;
    std::string t = s;
    if (t == ".inf" || t == ".nan" || t == "-.inf") return false;
    errno = 0;
    char* end = nullptr;
    double x = std::strtod(t.c_str(), &end);
    if (errno || *end || !std::isfinite(x)) return false;
    v = x;
    return true;
  }

  void expect_scalar(const YAML::Node& n, const std::string& path, const char* what) {
    if (!n.IsScalar()) fail(n, path, std::string("expected ") + what + ", got " + describe_node(n));
  }

  void convert(const YAML::Node& n, const std::string& path, bool& out) {
    expect_scalar(n, path, "true or false");
    const std::string& s = n.Scalar();
    if (!quoted(n) && (s == "true" || s == "True" || s == "TRUE")) out = true;
    else if (!quoted(n) && (s == "false" || s == "False" || s == "FALSE")) out = false;
    else fail(n, path, "expected true or false, got " + describe_node(n));
  }
  void convert(const YAML::Node& n, const std::string& path, int64_t& out) {
    expect_scalar(n, path, "an integer");
    if (quoted(n) || !parse_int(n.Scalar(), out)) fail(n, path, "expected an integer, got " + describe_node(n));
  }
  void convert(const YAML::Node& n, const std::string& path, double& out) {
    expect_scalar(n, path, "a number");
    if (quoted(n) || !parse_double(n.Scalar(), out)) fail(n, path, "expected a number, got " + describe_node(n));
  }
  void convert(const YAML::Node& n, const std::string& path, std::string& out) {
    expect_scalar(n, path, "a string");
    out = n.Scalar();
  }
  void convert(const YAML::Node& n, const std::string& path, std::vector<std::string>& out) {
    out.clear();
    if (n.IsScalar()) {  // a single name is a list of one
      out.push_back(n.Scalar());
      return;
    }
    if (!n.IsSequence()) fail(n, path, "expected a list of strings, got " + describe_node(n));
    for (size_t i = 0; i < n.size(); ++i) {
      std::string p = path + "[" + std::to_string(i) + "]";
      if (!n[i].IsScalar() || n[i].Scalar().empty())
        fail(n[i], p, "expected a non-empty string, got " + describe_node(n[i]));
      out.push_back(n[i].Scalar());
    }
  }
  void convert(const YAML::Node& n, const std::string& path, std::vector<double>& out) {
    out.clear();
    if (!n.IsSequence()) fail(n, path, "expected a list of numbers, got " + describe_node(n));
    for (size_t i = 0; i < n.size(); ++i) {
      double x = 0;
      convert(n[i], path + "[" + std::to_string(i) + "]", x);
      out.push_back(x);
    }
  }
  void convert(const YAML::Node& n, const std::string& path, std::vector<int64_t>& out) {
    out.clear();
    if (n.IsScalar()) {  // a single number is a list of one
      int64_t x = 0;
      convert(n, path, x);
      out.push_back(x);
      return;
    }
    if (!n.IsSequence()) fail(n, path, "expected a list of integers, got " + describe_node(n));
    for (size_t i = 0; i < n.size(); ++i) {
      int64_t x = 0;
      convert(n[i], path + "[" + std::to_string(i) + "]", x);
      out.push_back(x);
    }
  }
  void convert(const YAML::Node& n, const std::string& path, ZeroDpStrategy& out) {
    static const char* names[] = {"no_shard", "optim", "optim_grads", "optim_grads_params"};
    const std::string expected = "expected 0, 1, 2, 3 or one of no_shard, optim, optim_grads, optim_grads_params";
    expect_scalar(n, path, "0..3 or a strategy name");
    int64_t v = -1;
    if (!quoted(n) && parse_int(n.Scalar(), v)) {
      if (v < 0 || v > 3) fail(n, path, expected + ", got " + describe_node(n));
      out = static_cast<ZeroDpStrategy>(v);
      return;
    }
    for (int i = 0; i < 4; ++i)
      if (n.Scalar() == names[i]) {
        out = static_cast<ZeroDpStrategy>(i);
        return;
      }
    std::string hint = closest_match(n.Scalar(), {names, names + 4});
    fail(n, path, expected + ", got " + describe_node(n) + (hint.empty() ? "" : " (did you mean '" + hint + "'?)"));
  }
  // distributed.tp_plan: {"module.path.glob": style, ...}, in file order.
  void convert(const YAML::Node& n, const std::string& path, TpPlan& out) {
    out.clear();
    if (!n.IsMap()) fail(n, path, "expected a mapping from module-path globs to styles, e.g. {\"blocks.*.attn.c_attn\": \"colwise:3\"}, got " + describe_node(n));
    std::set<std::string> seen;
    for (auto it = n.begin(); it != n.end(); ++it) {
      const std::string key = it->first.IsScalar() ? it->first.Scalar() : std::string();
      const std::string p = path + "." + key;
      if (key.empty()) fail(it->first, path, "expected a module-path glob as key, got " + describe_node(it->first));
      if (!seen.insert(key).second) fail(it->first, p, "duplicate module pattern '" + key + "'");
      if (!it->second.IsScalar()) fail(it->second, p, "expected a style, got " + describe_node(it->second));
      TpStyle style;
      std::string expected = parse_tp_style(it->second.Scalar(), style);
      if (!expected.empty()) fail(it->second, p, "expected " + expected + ", got " + describe_node(it->second));
      locations_[p] = origins_.of(it->second, p);
      out.emplace_back(key, it->second.Scalar());
    }
  }
  // data.train / data.valid: "prefix", [a, b] (equal weights), [{path: a, weight: 0.3}, ...], or
  // Megatron's flat [0.3, a, 0.7, b].
  void convert(const YAML::Node& n, const std::string& path, std::vector<DataSource>& out) {
    out.clear();
    if (n.IsNull()) return;
    if (n.IsScalar()) {
      if (n.Scalar().empty()) fail(n, path, "expected a dataset path, got an empty string");
      out.push_back({n.Scalar(), 1.0});
      return;
    }
    if (!n.IsSequence() || n.size() == 0)
      fail(n, path, "expected a dataset path, a list of paths, or a list of {path, weight}, got " + describe_node(n));
    double w0 = 0;
    bool flat = n[0].IsScalar() && !quoted(n[0]) && parse_double(n[0].Scalar(), w0);
    if (flat) {
      if (n.size() % 2)
        fail(n, path, "a weighted list [w1, path1, w2, path2, ...] needs an even number of items, got " +
                          std::to_string(n.size()));
      for (size_t i = 0; i < n.size(); i += 2) {
        DataSource s;
        convert(n[i], path + "[" + std::to_string(i) + "]", s.weight);
        convert(n[i + 1], path + "[" + std::to_string(i + 1) + "]", s.path);
        out.push_back(s);
      }
    } else {
      for (size_t i = 0; i < n.size(); ++i) {
        std::string p = path + "[" + std::to_string(i) + "]";
        const YAML::Node& item = n[i];
        DataSource s;
        if (item.IsScalar()) {
          s.path = item.Scalar();
        } else if (item.IsMap()) {
          for (auto it = item.begin(); it != item.end(); ++it) {
            std::string k = it->first.Scalar();
            if (k == "path") convert(it->second, p + ".path", s.path);
            else if (k == "weight") convert(it->second, p + ".weight", s.weight);
            else fail(it->first, p + "." + k, "unknown key '" + k + "' in a dataset entry; expected 'path' and 'weight'");
          }
          if (!item["path"]) fail(item, p, "dataset entry has no 'path'");
        } else {
          fail(item, p, "expected a dataset path or {path, weight}, got " + describe_node(item));
        }
        out.push_back(s);
      }
    }
    for (size_t i = 0; i < out.size(); ++i) {
      if (out[i].path.empty()) fail(n, path, "dataset " + std::to_string(i) + " has an empty path");
      if (!(out[i].weight > 0)) fail(n, path, "dataset weights must be > 0, got " + std::to_string(out[i].weight));
    }
  }

  const Origins& origins_;
  std::map<std::string, std::string>& locations_;
  std::vector<Frame> stack_;
};

// ---------------------------------------------------------------------------------------------
class Writer {
 public:
  explicit Writer(YAML::Emitter& e) : e_(e) {}
  template <class F>
  void section(const char* key, F&& body) {
    e_ << YAML::Key << key << YAML::Value << YAML::BeginMap;
    body();
    e_ << YAML::EndMap;
  }
  template <class T, class... C>
  void field(const char* key, const T& v, C&&...) {
    e_ << YAML::Key << key << YAML::Value;
    emit(v);
  }
  void field(const char* key, schema::IntOrAuto v, schema::Check<int64_t>) {
    e_ << YAML::Key << key << YAML::Value;
    if (v.value->has_value()) e_ << **v.value;
    else e_ << "auto";
  }

 private:
  void emit(bool v) { e_ << (v ? "true" : "false"); }
  void emit(int64_t v) { e_ << v; }
  void emit(double v) {
    // The shortest text that reads back as the same double (0.1, not 0.10000000000000001).
    std::string s;
    for (int prec = 6; prec <= 17; ++prec) {
      std::ostringstream os;
      os.precision(prec);
      os << v;
      s = os.str();
      if (std::strtod(s.c_str(), nullptr) == v) break;
    }
    if (s.find_first_of(".eE") == std::string::npos) s += ".0";
    e_ << s;
  }
  void emit(const std::string& v) { e_ << YAML::DoubleQuoted << v; }
  void emit(ZeroDpStrategy v) { e_ << to_string(v); }
  void emit(const std::vector<std::string>& v) {
    e_ << YAML::Flow << YAML::BeginSeq;
    for (const auto& s : v) e_ << YAML::DoubleQuoted << s;
    e_ << YAML::EndSeq;
  }
  void emit(const std::vector<double>& v) {
    e_ << YAML::Flow << YAML::BeginSeq;
    for (double x : v) emit(x);
    e_ << YAML::EndSeq;
  }
  void emit(const std::vector<int64_t>& v) {
    e_ << YAML::Flow << YAML::BeginSeq;
    for (int64_t x : v) e_ << x;
    e_ << YAML::EndSeq;
  }
  void emit(const TpPlan& v) {
    e_ << YAML::BeginMap;
    for (const auto& [glob, style] : v) e_ << YAML::Key << YAML::DoubleQuoted << glob << YAML::Value << style;
    e_ << YAML::EndMap;
  }
  void emit(const std::vector<DataSource>& v) {
    if (v.empty()) {
      e_ << YAML::Null;
      return;
    }
    e_ << YAML::BeginSeq;
    for (const auto& s : v) {
      e_ << YAML::Flow << YAML::BeginMap << YAML::Key << "path" << YAML::Value << YAML::DoubleQuoted << s.path
         << YAML::Key << "weight" << YAML::Value;
      emit(s.weight);
      e_ << YAML::EndMap;
    }
    e_ << YAML::EndSeq;
  }
  template <class T>
  void emit(const std::optional<T>& v) {
    if (v) emit(*v);
    else e_ << YAML::Null;
  }

  YAML::Emitter& e_;
};

// ---------------------------------------------------------------------------------------------
void apply_override(YAML::Node root, const std::string& text, Origins& origins) {
  auto eq = text.find('=');
  auto bad = [&](const std::string& why) {
    throw ConfigError("command-line override '" + text + "': " + why);
  };
  if (eq == std::string::npos || eq == 0) bad("expected key.path=value");
  std::string key = text.substr(0, eq), value = text.substr(eq + 1);
  std::vector<std::string> parts = split(key, '.');
  for (const auto& p : parts) {
    if (p.empty()) bad("empty component in key '" + key + "'");
    for (char ch : p)
      if (!(std::isalnum(static_cast<unsigned char>(ch)) || ch == '_'))
        bad("invalid character '" + std::string(1, ch) + "' in key '" + key + "'");
  }
  YAML::Node parsed;
  try {
    parsed = value.empty() ? YAML::Node(YAML::NodeType::Null) : YAML::Load(value);
  } catch (const YAML::Exception&) {
    parsed = YAML::Node(value);  // not YAML: take it as a plain string
  }
  YAML::Node cur;
  cur.reset(root);
  for (size_t i = 0; i + 1 < parts.size(); ++i) {
    YAML::Node next = cur[parts[i]];
    if (!next.IsDefined() || next.IsNull()) {
      cur[parts[i]] = YAML::Node(YAML::NodeType::Map);
      next.reset(cur[parts[i]]);
    } else if (!next.IsMap()) {
      bad("'" + join({parts.begin(), parts.begin() + i + 1}, ".") + "' is not a section");
    }
    cur.reset(next);
  }
  cur[parts.back()] = parsed;
  origins.overrides.emplace_back(key, text);
}

void validate(Config& c) {
  auto fail = [&](const std::string& key, const std::string& msg) {
    throw ConfigError(c.where(key) + ": " + key + ": " + msg);
  };
  const auto& d = c.distributed;
  const auto& t = c.training;
  if (c.model.path.empty()) fail("model.path", "required: the TorchScript model file to train");
  if (c.data.train.empty()) fail("data.train", "required: a dataset path (Megatron prefix or llm.c .bin)");
  if (!c.model.init_rules.empty() && !d.init_fsdp_with_meta_device)
    fail("model.init_rules", "initialisation rules apply only with distributed.init_fsdp_with_meta_device: true "
                             "(otherwise the weights come from the model file)");
  if (d.keep_fp8_transpose_cache)
    fail("distributed.keep_fp8_transpose_cache",
         "not supported: this build has no FP8 compute (no Transformer Engine), so there is no FP8 transpose "
         "cache to keep; set it to false");
  if (d.fsdp_double_buffer && d.zero_dp_strategy != ZeroDpStrategy::kOptimGradsParams)
    fail("distributed.fsdp_double_buffer",
         std::string("double buffering applies to the gathered weight buffers, which exist only with "
                     "zero_dp_strategy optim_grads_params (3); got ") + to_string(d.zero_dp_strategy));
  if (d.nccl_ub && !d.fsdp_double_buffer)
    fail("distributed.nccl_ub", "NCCL user buffers are registered on the persistent double buffers: "
                                "set fsdp_double_buffer: true as well");
  if (d.backend == "nccl" && t.device == "cpu")
    fail("distributed.backend", "nccl carries CUDA tensors; with training.device: cpu the collectives use mpi "
                                "(set backend: auto or mpi, or device: cuda)");
  if (d.average_in_collective && d.calculate_per_token_loss)
    fail("distributed.average_in_collective",
         "cannot be combined with calculate_per_token_loss: per-token loss sums gradients over the data-parallel "
         "group and normalises by the global token count, while average_in_collective divides by the dp size");
  if (d.dp_size && *d.dp_size % d.dp_replicate_size != 0)
    fail("distributed.dp_replicate_size", "dp_size (" + std::to_string(*d.dp_size) +
                                              ") must be a multiple of dp_replicate_size (" +
                                              std::to_string(d.dp_replicate_size) + ")");
  if (d.sequence_parallel && d.tp_size == 1)
    fail("distributed.sequence_parallel", "sequence parallelism splits activations across the tensor-parallel group; "
                                          "it needs distributed.tp_size > 1 (got 1)");
  if (t.global_batch_size % t.micro_batch_size != 0)
    fail("training.global_batch_size", "must be a multiple of training.micro_batch_size (" +
                                           std::to_string(t.micro_batch_size) + "), got " +
                                           std::to_string(t.global_batch_size));
  if (d.cp_size > 1 && t.seq_length % (2 * d.cp_size) != 0)
    fail("training.seq_length", "with cp_size " + std::to_string(d.cp_size) + " the sequence is cut into 2 x cp_size = " +
                                    std::to_string(2 * d.cp_size) + " load-balanced chunks, so seq_length must be a "
                                    "multiple of " + std::to_string(2 * d.cp_size) + ", got " + std::to_string(t.seq_length));
  // A short run of a long config (training.max_steps=10 to try it) is legitimate: the schedule stays
  // defined (the learning rate is still warming up when the run ends), so this is only a warning.
  if (c.lr_scheduler.warmup_steps > t.max_steps)
    c.warnings.push_back(c.where("lr_scheduler.warmup_steps") + ": lr_scheduler.warmup_steps (" +
                         std::to_string(c.lr_scheduler.warmup_steps) + ") exceeds training.max_steps (" +
                         std::to_string(t.max_steps) + "): the run ends before the warmup does");
  if (c.lr_scheduler.min_lr > c.optimizer.lr)
    fail("lr_scheduler.min_lr", "must not exceed optimizer.lr (" + std::to_string(c.optimizer.lr) + ")");
  if (c.lr_scheduler.decay_steps && c.lr_scheduler.wsd_decay_steps &&
      *c.lr_scheduler.wsd_decay_steps > *c.lr_scheduler.decay_steps)
    fail("lr_scheduler.wsd_decay_steps", "must not exceed lr_scheduler.decay_steps");
  if (c.data.valid.empty() && c.data.valid_fraction == 0.0 && t.eval_every > 0)
    fail("training.eval_every", "evaluation needs data.valid or data.valid_fraction > 0");
  if (c.data.eod_mask_loss && !c.data.eod_token)
    fail("data.eod_mask_loss", "needs data.eod_token, the id to mask (256 for prepare-data's byte tokenizer)");
  if (c.checkpoint.save_every > 0 && !c.checkpoint.dir)
    fail("checkpoint.save_every", "checkpoint.dir must be set to save checkpoints");
  const ProfilingConfig& p = c.profiling;
  if (p.enabled && p.end_step < p.start_step)
    fail("profiling.end_step", "must not be before profiling.start_step (" + std::to_string(p.start_step) + "), got " +
                                   std::to_string(p.end_step));
  // Like the warmup above, a short trial run of a profiling config is legitimate: a warning, and the
  // trainer says again at the end that nothing was recorded.
  if (p.enabled && p.start_step > t.max_steps)
    c.warnings.push_back(c.where("profiling.start_step") + ": profiling.start_step (" + std::to_string(p.start_step) +
                         ") is beyond training.max_steps (" + std::to_string(t.max_steps) +
                         "): no step will be profiled");
}

Config load_from_node(YAML::Node root, Origins& origins, const std::vector<std::string>& overrides) {
  if (!root.IsDefined() || root.IsNull())
    throw ConfigError(origins.file + ":1:1: the config is empty; expected a mapping with sections such as "
                      "model:, data:, training:, distributed:");
  if (!root.IsMap())
    throw ConfigError(origins.of(root, "") + ": expected a mapping of sections at the top level, got " +
                      describe_node(root));
  for (const auto& o : overrides) apply_override(root, o, origins);
  Config cfg;
  cfg.source = origins.file;
  Reader reader(origins, root, cfg.locations);
  schema::describe(cfg, reader);
  reader.finish();
  validate(cfg);
  return cfg;
}

YAML::Node parse_yaml(const std::string& text, const std::string& name) {
  try {
    return YAML::Load(text);
  } catch (const YAML::ParserException& e) {
    throw ConfigError(name + ":" + std::to_string(e.mark.line + 1) + ":" + std::to_string(e.mark.column + 1) +
                      ": YAML syntax error: " + e.msg);
  }
}

}  // namespace

Config load_config_string(const std::string& yaml, const std::string& source_name,
                          const std::vector<std::string>& overrides) {
  Origins origins{source_name, {}};
  return load_from_node(parse_yaml(yaml, source_name), origins, overrides);
}

Config load_config_file(const std::string& path, const std::vector<std::string>& overrides) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw ConfigError(path + ": cannot open config file: " + std::strerror(errno));
  std::stringstream ss;
  ss << in.rdbuf();
  return load_config_string(ss.str(), path, overrides);
}

std::string to_yaml(const Config& cfg) {
  YAML::Emitter e;
  e << YAML::BeginMap;
  Writer w(e);
  schema::describe(const_cast<Config&>(cfg), w);  // the writer only reads
  e << YAML::EndMap;
  return std::string(e.c_str()) + "\n";
}

void check_batch_against_dp(const Config& c, int64_t dp) {
  const auto& t = c.training;
  if (t.global_batch_size % (t.micro_batch_size * dp) != 0)
    throw ConfigError(c.where("training.global_batch_size") + ": training.global_batch_size (" +
                      std::to_string(t.global_batch_size) + ") must be a multiple of micro_batch_size (" +
                      std::to_string(t.micro_batch_size) + ") x data-parallel size (" + std::to_string(dp) +
                      ") = " + std::to_string(t.micro_batch_size * dp));
}

void check_against_world(const Config& c, int64_t world) {
  if (!c.profiling.enabled) return;
  for (int64_t r : c.profiling.ranks)
    if (r >= world)
      throw ConfigError(c.where("profiling.ranks") + ": profiling.ranks: rank " + std::to_string(r) +
                        " does not exist in a run of " + std::to_string(world) + (world == 1 ? " rank" : " ranks") +
                        " (0.." + std::to_string(world - 1) + ")");
}

int64_t grad_accum_steps(const Config& c, int64_t dp) {
  check_batch_against_dp(c, dp);
  return c.training.global_batch_size / (c.training.micro_batch_size * dp);
}

}  // namespace mfsdp
