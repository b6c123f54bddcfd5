// Text through fixed tokenizers that use every pre-tokenizer and normalizer kind: the input is the
// text (valid UTF-8 only, as prepare-data checks before encoding).
#include <cstring>
#include <memory>

#include "fuzz_util.h"
#include "tokenizer/text.h"
#include "tokenizer/tokenizer.h"

namespace {
const char* kTokenizers[] = {
    // byte-level BPE, GPT-2 layout, with an added token
    R"J({"added_tokens":[{"id":9,"content":"<|e|>","special":true,"normalized":false,"lstrip":true,"rstrip":true}],
        "normalizer":{"type":"NFKC"},
        "pre_tokenizer":{"type":"ByteLevel","add_prefix_space":true},
        "post_processor":{"type":"TemplateProcessing","single":[{"SpecialToken":{"id":"<|e|>"}},{"Sequence":{"id":"A"}}],
                          "special_tokens":{"<|e|>":{"id":"<|e|>","ids":[9]}}},
        "model":{"type":"BPE","vocab":{"a":0,"b":1,"ab":2,"Ġ":3,"Ġa":4,"c":5,"abc":6,"<|e|>":9},
                 "merges":["a b","Ġ a",["ab","c"]]}})J",
    // byte fallback with the Metaspace marker, unknown token fused
    R"J({"added_tokens":[{"id":0,"content":"<unk>","special":true,"normalized":false},
                        {"id":1,"content":"<s>","special":true,"normalized":false,"single_word":true}],
        "normalizer":{"type":"Sequence","normalizers":[{"type":"Lowercase"},{"type":"StripAccents"},
                     {"type":"Replace","pattern":{"Regex":"\\s+"},"content":" "},{"type":"Strip"}]},
        "pre_tokenizer":{"type":"Sequence","pretokenizers":[{"type":"Metaspace","replacement":"▁","prepend_scheme":"first","split":true},
                        {"type":"Digits","individual_digits":true},{"type":"Punctuation","behavior":"MergedWithPrevious"}]},
        "model":{"type":"BPE","unk_token":"<unk>","fuse_unk":true,"byte_fallback":true,
                 "vocab":{"<unk>":0,"<s>":1,"<0x41>":2,"<0xC3>":3,"▁":4,"a":5,"▁a":6,"1":7},"merges":["▁ a"]}})J",
    // Split with every behavior, whitespace splitters, subword prefix and suffix
    R"J({"pre_tokenizer":{"type":"Sequence","pretokenizers":[
          {"type":"Split","pattern":{"Regex":"\\p{N}{1,3}"},"behavior":"Isolated","invert":false},
          {"type":"Split","pattern":{"String":","},"behavior":"MergedWithNext","invert":true},
          {"type":"Split","pattern":{"Regex":"(?=x)"},"behavior":"Contiguous"},
          {"type":"WhitespaceSplit"},{"type":"Whitespace"},{"type":"CharDelimiterSplit","delimiter":"-"}]},
        "model":{"type":"BPE","unk_token":"?","continuing_subword_prefix":"##","end_of_word_suffix":"</w>",
                 "vocab":{"?":0,"a":1,"##a":2,"##a</w>":3,"a</w>":4,"aa":5},"merges":[["a","##a"]]}})J",
};
}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* d, size_t n) {
  static std::vector<std::unique_ptr<mfsdp::Tokenizer>> toks = [] {
    std::vector<std::unique_ptr<mfsdp::Tokenizer>> v;
    for (size_t i = 0; i < sizeof kTokenizers / sizeof *kTokenizers; ++i) {
      std::string p = fuzz::scratch(("_enc" + std::to_string(i) + ".json").c_str());
      fuzz::write_file(p, reinterpret_cast<const uint8_t*>(kTokenizers[i]), std::strlen(kTokenizers[i]));
      v.push_back(mfsdp::tok_detail::load_hf_json(p, {}));
    }
    mfsdp::TokenizerOptions o;
    return v;
  }();
  static std::vector<std::unique_ptr<mfsdp::TokenizerSession>> sessions = [] {
    std::vector<std::unique_ptr<mfsdp::TokenizerSession>> v;
    for (auto& t : toks) v.push_back(t->session());
    return v;
  }();
  std::string_view text(reinterpret_cast<const char*>(d), n);
  if (mfsdp::text::invalid_utf8_at(text) != std::string_view::npos) return 0;
  std::vector<int32_t> ids;
  for (auto& s : sessions) {
    ids.clear();
    fuzz::expect_user_errors_only([&] { s->encode(text, ids); });
  }
  return 0;
}
