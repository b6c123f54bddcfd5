// Data: Megatron indexed datasets (every dtype code, validation of truncated and mismatched
// files), llm.c token files, GPT windows, epochs, blends, the validation split, determinism, the
// prefetch thread.
#include <atomic>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <set>
#include <unistd.h>

#include "catch.h"
#include "config/config.h"
#include "data/batch_prefetcher.h"
#include "data/gpt_dataset.h"
#include "data/prepare.h"
#include "data/token_source.h"
#include "util/error.h"

using namespace mfsdp;

namespace {

std::string tmpdir() {
  static std::string dir = [] {
    char tmpl[] = "/tmp/mfsdp_test_data_XXXXXX";
    return std::string(mkdtemp(tmpl));
  }();
  return dir;
}

template <class T>
void put(std::ofstream& f, T v) { f.write(reinterpret_cast<const char*>(&v), sizeof v); }

// A Megatron dataset by hand (independent of our writer): `docs` token lists, dtype code.
std::string write_megatron(const std::string& name, const std::vector<std::vector<int64_t>>& docs, int code) {
  std::string prefix = tmpdir() + "/" + name;
  std::ofstream bin(prefix + ".bin", std::ios::binary), idx(prefix + ".idx", std::ios::binary);
  const int es = megatron_dtype_size(code);
  std::vector<int64_t> ptrs;
  int64_t off = 0;
  for (const auto& d : docs) {
    ptrs.push_back(off);
    for (int64_t t : d) {
      switch (code) {
        case 1: put<uint8_t>(bin, uint8_t(t)); break;
        case 2: put<int8_t>(bin, int8_t(t)); break;
        case 3: put<int16_t>(bin, int16_t(t)); break;
        case 4: put<int32_t>(bin, int32_t(t)); break;
        case 5: put<int64_t>(bin, t); break;
        case 6: put<double>(bin, double(t)); break;
        case 7: put<float>(bin, float(t)); break;
        case 8: put<uint16_t>(bin, uint16_t(t)); break;
      }
    }
    off += int64_t(d.size()) * es;
  }
  idx.write("MMIDIDX\x00\x00", 9);
  put<uint64_t>(idx, 1);
  put<uint8_t>(idx, uint8_t(code));
  put<uint64_t>(idx, docs.size());
  put<uint64_t>(idx, docs.size() + 1);
  for (const auto& d : docs) put<int32_t>(idx, int32_t(d.size()));
  for (int64_t p : ptrs) put<int64_t>(idx, p);
  for (size_t i = 0; i <= docs.size(); ++i) put<int64_t>(idx, int64_t(i));
  return prefix;
}

std::string error_of(const std::function<void()>& fn) {
  try {
    fn();
  } catch (const UserError& e) {
    return e.what();
  }
  return "";
}

std::vector<std::vector<int64_t>> sample_docs() { return {{1, 2, 3, 4, 5}, {10, 11, 12}, {20, 21, 22, 23}, {30, 31}}; }

}  // namespace

TEST_CASE("Megatron datasets of every dtype code read back exactly") {
  for (int code = 1; code <= 8; ++code) {
    INFO("dtype code " << code);
    auto prefix = write_megatron("dt" + std::to_string(code), sample_docs(), code);
    auto src = TokenSource::open(prefix, "auto");
    CHECK(src->kind() == "megatron");
    REQUIRE(src->num_sequences() == 4);
    CHECK(src->seq_length(2) == 4);
    std::vector<int64_t> out(4);
    src->read(src->seq_offset(2), 4, out.data());
    CHECK(out == std::vector<int64_t>{20, 21, 22, 23});
    CHECK(src->doc_bounds().size() == 5);
  }
}

TEST_CASE("truncated, mismatched and malformed Megatron files are errors naming the file") {
  auto prefix = write_megatron("good", sample_docs(), 8);
  // Truncated .bin.
  auto trunc = write_megatron("trunc", sample_docs(), 8);
  REQUIRE(truncate((trunc + ".bin").c_str(), 20) == 0);
  std::string e = error_of([&] { TokenSource::open(trunc, "auto"); });
  CHECK(e.find(trunc + ".bin") != std::string::npos);
  CHECK(e.find("truncated") != std::string::npos);
  // A .bin from another dataset (longer).
  auto other = write_megatron("other", {{1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15}}, 8);
  auto mism = write_megatron("mism", sample_docs(), 8);
  std::rename((other + ".bin").c_str(), (mism + ".bin").c_str());
  e = error_of([&] { TokenSource::open(mism, "auto"); });
  CHECK(e.find("mismatched") != std::string::npos);
  // Truncated .idx.
  auto ti = write_megatron("tidx", sample_docs(), 8);
  REQUIRE(truncate((ti + ".idx").c_str(), 60) == 0);
  e = error_of([&] { TokenSource::open(ti, "auto"); });
  CHECK(e.find(ti + ".idx") != std::string::npos);
  // Wrong magic, unknown dtype code.
  auto bm = write_megatron("badmagic", sample_docs(), 8);
  { std::fstream f(bm + ".idx", std::ios::in | std::ios::out | std::ios::binary); f.write("XXIDIDX", 7); }
  CHECK(error_of([&] { TokenSource::open(bm, "auto"); }).find("wrong magic") != std::string::npos);
  auto bc = write_megatron("badcode", sample_docs(), 8);
  { std::fstream f(bc + ".idx", std::ios::in | std::ios::out | std::ios::binary); f.seekp(17); f.put(char(42)); }
  CHECK(error_of([&] { TokenSource::open(bc, "auto"); }).find("unknown dtype code 42") != std::string::npos);
  // Missing half of the pair; nothing at all.
  auto half = write_megatron("half", sample_docs(), 8);
  std::remove((half + ".bin").c_str());
  CHECK(error_of([&] { TokenSource::open(half, "auto"); }).find(half + ".bin: missing") != std::string::npos);
  CHECK(error_of([&] { TokenSource::open(tmpdir() + "/nothing", "auto"); }).find("no dataset here") != std::string::npos);
}

TEST_CASE("llm.c token files: GPT-2 (uint16) and Llama 3 (uint32), with header checks") {
  auto write = [&](const std::string& name, int32_t magic, int32_t version, const std::vector<int64_t>& toks, int es,
                   int32_t claimed) {
    std::string path = tmpdir() + "/" + name + ".bin";
    std::ofstream f(path, std::ios::binary);
    std::vector<int32_t> header(256, 0);
    header[0] = magic;
    header[1] = version;
    header[2] = claimed;
    f.write(reinterpret_cast<const char*>(header.data()), 1024);
    for (int64_t t : toks) {
      if (es == 2) put<uint16_t>(f, uint16_t(t));
      else put<uint32_t>(f, uint32_t(t));
    }
    return path;
  };
  auto g = write("gpt2", 20240520, 1, {5, 50256, 7}, 2, 3);
  auto src = TokenSource::open(g, "auto");
  CHECK(src->kind() == "llmc");
  std::vector<int64_t> out(3);
  src->read(0, 3, out.data());
  CHECK(out == std::vector<int64_t>{5, 50256, 7});
  auto l = write("llama3", 20240801, 7, {128000, 9, 100000}, 4, 3);
  src = TokenSource::open(l, "llmc");
  src->read(0, 3, out.data());
  CHECK(out == std::vector<int64_t>{128000, 9, 100000});
  CHECK(error_of([&] { TokenSource::open(write("short", 20240520, 1, {1, 2}, 2, 3), "auto"); }).find("truncated") !=
        std::string::npos);
  CHECK(error_of([&] { TokenSource::open(write("magic", 1234, 1, {1}, 2, 1), "llmc"); }).find("magic 1234") !=
        std::string::npos);
  CHECK(error_of([&] { TokenSource::open(write("ver", 20240801, 3, {1}, 4, 1), "llmc"); }).find("version 3") !=
        std::string::npos);
}

TEST_CASE("GPT samples: windows of seq+1 tokens with stride seq over concatenated sequences") {
  auto prefix = write_megatron("win", sample_docs(), 8);
  auto src = TokenSource::open(prefix, "auto");
  std::vector<TokenRange> ranges;
  for (int64_t s = 0; s < src->num_sequences(); ++s) ranges.push_back({src.get(), src->seq_offset(s), src->seq_length(s)});
  GptSamples plain("t", ranges, 3, 1, /*shuffle=*/false);
  CHECK(plain.samples_per_epoch() == (14 - 1) / 3);
  std::vector<int64_t> w(4);
  plain.get(0, w.data());
  CHECK(w == std::vector<int64_t>{1, 2, 3, 4});
  plain.get(1, w.data());
  CHECK(w == std::vector<int64_t>{4, 5, 10, 11});  // crosses a sequence boundary
  // Shuffled: each epoch is a permutation of windows, deterministic in the seed.
  GptSamples a("a", ranges, 3, 42, true), b("b", ranges, 3, 42, true), c("c", ranges, 3, 43, true);
  bool any_diff = false;
  for (int64_t i = 0; i < 3 * a.samples_per_epoch(); ++i) {
    std::vector<int64_t> x(4), y(4), z(4);
    a.get(i, x.data());
    b.get(i, y.data());
    c.get(i, z.data());
    CHECK(x == y);
    any_diff |= x != z;
  }
  CHECK(any_diff);
  CHECK(error_of([&] { GptSamples("tiny", ranges, 100, 1, true); }).find("fewer than training.seq_length + 1") !=
        std::string::npos);
}

TEST_CASE("blends follow the weights exactly and deterministically") {
  auto p1 = write_megatron("b1", {{1, 1, 1, 1, 1, 1, 1, 1, 1}}, 8);
  auto p2 = write_megatron("b2", {{2, 2, 2, 2, 2, 2, 2, 2, 2}}, 8);
  auto s1 = TokenSource::open(p1, "auto"), s2 = TokenSource::open(p2, "auto");
  std::vector<std::unique_ptr<GptSamples>> parts;
  parts.push_back(std::make_unique<GptSamples>("1", std::vector<TokenRange>{{s1.get(), 0, 9}}, 2, 1, true));
  parts.push_back(std::make_unique<GptSamples>("2", std::vector<TokenRange>{{s2.get(), 0, 9}}, 2, 1, true));
  BlendedSamples blend(std::move(parts), {0.25, 0.75});
  int ones = 0;
  for (int i = 0; i < 400; ++i) {
    std::vector<int64_t> w(3);
    blend.get(i, w.data());
    ones += w[0] == 1;
  }
  CHECK(ones == 100);
}

TEST_CASE("blends keep constant state whatever the number of samples drawn, in any access order") {
  auto p1 = write_megatron("c1", {{1, 1, 1, 1, 1, 1, 1, 1, 1}}, 8);
  auto p2 = write_megatron("c2", {{2, 2, 2, 2, 2, 2, 2, 2, 2}}, 8);
  auto p3 = write_megatron("c3", {{3, 3, 3, 3, 3, 3, 3, 3, 3}}, 8);
  auto s1 = TokenSource::open(p1, "auto"), s2 = TokenSource::open(p2, "auto"), s3 = TokenSource::open(p3, "auto");
  auto make = [&] {
    std::vector<std::unique_ptr<GptSamples>> parts;
    for (auto* src : {s1.get(), s2.get(), s3.get()})
      parts.push_back(std::make_unique<GptSamples>("p", std::vector<TokenRange>{{src, 0, 9}}, 2, 1, true));
    return std::make_unique<BlendedSamples>(std::move(parts), std::vector<double>{0.2, 0.3, 0.5});
  };
  // Megatron's rule written out: the dataset of every sample, by brute force.
  std::vector<int> want;
  std::vector<int64_t> counts(3, 0);
  for (int i = 0; i < 300000; ++i) {
    int best = 0;
    double best_err = -1e300;
    for (int d = 0; d < 3; ++d) {
      const double err = std::vector<double>{0.2, 0.3, 0.5}[d] * (i + 1) - double(counts[d]);
      if (err > best_err) best_err = err, best = d;
    }
    ++counts[best];
    want.push_back(best + 1);
  }
  auto blend = make();
  const size_t state = blend->state_bytes();
  std::vector<int64_t> w(3);
  for (int i = 0; i < 300000; ++i) {
    blend->get(i, w.data());
    if (w[0] != want[i]) FAIL("sample " << i << ": dataset " << w[0] << ", expected " << want[i]);
  }
  CHECK(blend->state_bytes() == state);  // nothing kept per sample
  // Out of order (a resumed run starts far in; evaluation goes back to 0): the same answers.
  for (int i : {250000, 250001, 17, 18, 299999, 0, 5}) {
    blend->get(i, w.data());
    CHECK(w[0] == want[i]);
  }
}

TEST_CASE("pipeline: disjoint data-parallel parts that together equal the single-rank batch; valid split") {
  auto prefix = tmpdir() + "/pipe";
  {
    std::ofstream t(tmpdir() + "/pipe.txt");
    for (int i = 0; i < 200; ++i) t << "line " << i << " of the test corpus\n";
  }
  PrepareOptions po;
  po.inputs = {tmpdir() + "/pipe.txt"};
  po.output_prefix = prefix;
  po.split_lines = true;
  po.progress = 0;
  prepare_data(po);
  Config cfg = load_config_string("model: {path: m}\ndata: {train: " + prefix + ", valid_fraction: 0.1}\n"
                                  "training: {global_batch_size: 8, micro_batch_size: 2, seq_length: 16}\n", "p.yaml");
  DataPipeline one(cfg, 0, 1);
  std::vector<std::vector<int64_t>> whole;
  for (int k = 0; k < 4; ++k) {
    auto b = one.train_batch(3, k);
    for (int r = 0; r < 2; ++r) {
      auto row = b.tokens[r];
      whole.emplace_back(row.data_ptr<int64_t>(), row.data_ptr<int64_t>() + 16);
    }
  }
  std::vector<std::vector<int64_t>> parts;
  for (int rank = 0; rank < 2; ++rank) {
    DataPipeline p(cfg, rank, 2);
    for (int k = 0; k < 2; ++k) {
      auto b = p.train_batch(3, k);
      CHECK(b.targets.slice(1, 0, 15).equal(b.tokens.slice(1, 1, 16)));
      CHECK(b.position_ids[1][5].item<int64_t>() == 5);
      for (int r = 0; r < 2; ++r) {
        auto row = b.tokens[r];
        parts.emplace_back(row.data_ptr<int64_t>(), row.data_ptr<int64_t>() + 16);
      }
    }
  }
  CHECK(parts == whole);
  REQUIRE(one.has_valid());
  auto v1 = one.valid_batch(0, 0), v2 = one.valid_batch(0, 0);
  CHECK(v1.tokens.equal(v2.tokens));  // the same samples at every evaluation
}

TEST_CASE("prepare-data: byte-level tokens with end-of-document, one document per line") {
  std::ofstream(tmpdir() + "/p.txt") << "ab\n\ncd\n";
  PrepareOptions po;
  po.inputs = {tmpdir() + "/p.txt"};
  po.output_prefix = tmpdir() + "/p";
  po.split_lines = true;
  po.progress = 0;
  auto r = prepare_data(po);
  CHECK(r.documents == 2);
  CHECK(r.tokens == 8);  // "ab\n" EOD "cd\n" EOD
  auto src = TokenSource::open(tmpdir() + "/p", "megatron");
  std::vector<int64_t> out(8);
  src->read(0, 8, out.data());
  CHECK(out == std::vector<int64_t>{'a', 'b', '\n', kByteEod, 'c', 'd', '\n', kByteEod});
  po.inputs = {tmpdir() + "/missing.txt"};
  po.output_prefix = tmpdir() + "/q";
  CHECK(error_of([&] { prepare_data(po); })
            .find("missing.txt: cannot open") != std::string::npos);
  std::ifstream leftover(tmpdir() + "/q.bin");
  CHECK_FALSE(leftover.good());  // nothing half-written
}

TEST_CASE("data.shuffle: false reads the windows in file order") {
  auto prefix = write_megatron("noshuffle", {{1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13}}, 8);
  Config cfg = load_config_string("model: {path: m}\ndata: {train: " + prefix + ", shuffle: false}\n"
                                  "training: {global_batch_size: 2, micro_batch_size: 1, seq_length: 3}\n", "s.yaml");
  DataPipeline p(cfg, 0, 1);
  CHECK(p.train_batch(0, 0).tokens[0][0].item<int64_t>() == 1);
  CHECK(p.train_batch(0, 1).tokens[0][0].item<int64_t>() == 4);
  Config shuffled = load_config_string("model: {path: m}\ndata: {train: " + prefix + "}\n"
                                       "training: {global_batch_size: 2, micro_batch_size: 1, seq_length: 3}\n", "s.yaml");
  DataPipeline q(shuffled, 0, 1);
  std::vector<int64_t> firsts;
  for (int k = 0; k < 4; ++k) firsts.push_back(q.train_batch(k / 2, k % 2).tokens[0][0].item<int64_t>());
  CHECK(firsts != std::vector<int64_t>{1, 4, 7, 10});
}

TEST_CASE("prefetch thread: the batches of reading on the main thread, in order; an error at its own step") {
  auto prefix = write_megatron("prefetch", {{1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13}, {20, 21, 22, 23, 24, 25, 26, 27}}, 8);
  Config cfg = load_config_string("model: {path: m}\ndata: {train: " + prefix + "}\n"
                                  "training: {global_batch_size: 4, micro_batch_size: 1, seq_length: 3}\n", "f.yaml");
  // Steps 2..6 of 4 micro-batches: the later steps cross into further epochs (reshuffled).
  DataPipeline direct(cfg, 0, 1), threaded(cfg, 0, 1);
  {
    BatchPrefetcher pf([&](int64_t s, int64_t k) { return threaded.train_batch(s, k); }, 4, 2, 7, 2);
    for (int64_t step = 2; step < 7; ++step) {
      std::vector<HostBatch> got = pf.take(step);
      REQUIRE(got.size() == 4);
      for (int64_t k = 0; k < 4; ++k) {
        Batch want = direct.train_batch(step, k);
        CHECK(got[k].batch.tokens.equal(want.tokens));
        CHECK(got[k].batch.targets.equal(want.targets));
        CHECK(got[k].batch.loss_mask.equal(want.loss_mask));
        CHECK(got[k].batch.position_ids.equal(want.position_ids));
        CHECK(got[k].tokens == 3);
        CHECK(got[k].max_token == std::max(want.tokens.max().item<int64_t>(), want.targets.max().item<int64_t>()));
      }
    }
    // Past the end, or not the next step: a logic error, not a wait.
    CHECK_THROWS_AS(pf.take(7), std::logic_error);
  }
  // A reader that fails at step 4: steps 2 and 3 arrive, take(4) throws the reader's error (the
  // thread stops reading there), and a step out of order is refused.
  std::atomic<int64_t> reads{0};
  BatchPrefetcher failing(
      [&](int64_t s, int64_t k) {
        ++reads;
        if (s == 4 && k == 1) throw UserError("data: step 4 is unreadable");
        return direct.train_batch(s, k);
      },
      2, 2, 100, 3);
  CHECK_THROWS_AS(failing.take(3), std::logic_error);
  CHECK(failing.take(2).size() == 2);
  CHECK(failing.take(3).size() == 2);
  CHECK(error_of([&] { failing.take(4); }) == "data: step 4 is unreadable");
  CHECK(reads.load() == 6);  // 2 + 2 + the failing step's two calls, nothing after it
  // Destroyed with steps left unread (a run that stops early): the thread ends, nothing hangs.
  {
    BatchPrefetcher early([&](int64_t s, int64_t k) { return direct.train_batch(s % 3, k); }, 1, 0, 1000000, 2);
    CHECK(early.take(0).size() == 1);
  }
  // The host batch's counts: a loss mask with zeros counts only the ones.
  Batch b = direct.train_batch(0, 0);
  b.loss_mask[0][1] = 0.0f;
  HostBatch h = host_batch(b);
  CHECK(h.tokens == 2);
}

TEST_CASE("mapped file: dropped pages read back the same bytes") {
  const std::string path = tmpdir() + "/pages.bin";
  std::vector<int64_t> v(100000);
  for (size_t i = 0; i < v.size(); ++i) v[i] = int64_t(i * 7919 % 100003);
  std::ofstream(path, std::ios::binary).write(reinterpret_cast<const char*>(v.data()), std::streamsize(v.size() * 8));
  MappedFile f(path);
  REQUIRE(f.size() == v.size() * 8);
  CHECK(std::memcmp(f.data(), v.data(), f.size()) == 0);
  f.drop_pages(12345, 300000);  // an unaligned range inside the file
  f.drop_pages(0, f.size() * 2);  // past the end: clamped
  f.drop_pages(f.size() + 10, 5);  // outside: nothing
  CHECK(std::memcmp(f.data(), v.data(), f.size()) == 0);
}
