#!/usr/bin/env python3
"""mfsdp prepare-data against the reference tokenizer libraries, id for id, on genuine vocabularies.

  check_tokenizers.py --mfsdp BIN --vocab DIR --work DIR CASE [CASE ...]

For each case (a tokenizer and its reference: Hugging Face `tokenizers`, `tiktoken` or
`sentencepiece`) and each corpus, `mfsdp prepare-data` writes a Megatron dataset; the ids of every
document are compared with what the reference library gives for the same text. Corpora:
  kjv           the King James Bible (Debian's bible-kjv), one document per verse line
  licenses      /usr/share/common-licenses/*, one document per file
  multilingual  translated messages of coreutils, dpkg, bash, apt, ... (their .mo catalogs, up to
                600 per language for ~45 languages: Arabic, Cyrillic, Greek, Hebrew, Devanagari, Tamil,
                Thai, Georgian, CJK, Hangul, Vietnamese, ...), JSONL
  edge          4,000 seeded random strings mixing scripts, emoji, combining marks, odd whitespace,
                digits, contractions and special-token texts (<s>, <|endoftext|>), JSONL
Any mismatch fails the case with the first differing document shown. The vocabularies come from
scripts/tokenizers/fetch_vocabularies.py.
"""
import argparse
import base64
import gettext
import glob
import json
import os
import random
import subprocess
import sys
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "scripts", "tokenizers"))
from fetch_vocabularies import GPT2_PATTERN, load_ranks  # noqa: E402  (one reader of rank files)


def ref_hf(path):
    from tokenizers import Tokenizer
    t = Tokenizer.from_file(path)
    return lambda texts: [e.ids for e in t.encode_batch(texts)]


def ref_gpt2_dir(d):
    from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers
    t = Tokenizer(models.BPE.from_file(os.path.join(d, "vocab.json"), os.path.join(d, "merges.txt")))
    t.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    t.add_special_tokens([AddedToken("<|endoftext|>", special=True, normalized=False)])
    return lambda texts: [e.ids for e in t.encode_batch(texts)]


def ref_tiktoken(path, pattern):
    import tiktoken
    enc = tiktoken.Encoding(os.path.basename(path), pat_str=pattern, mergeable_ranks=load_ranks(path), special_tokens={})
    return lambda texts: enc.encode_ordinary_batch(texts, num_threads=2)


def ref_tekken(path):
    import tiktoken
    d = json.load(open(path))
    cfg = d["config"]
    nspecial = cfg["default_num_special_tokens"]
    inner = cfg["default_vocab_size"] - nspecial
    ranks = {base64.b64decode(v["token_bytes"]): v["rank"] for v in d["vocab"][:inner]}
    enc = tiktoken.Encoding("tekken", pat_str=cfg["pattern"], mergeable_ranks=ranks, special_tokens={})
    return lambda texts: [[i + nspecial for i in ids] for ids in enc.encode_ordinary_batch(texts, num_threads=2)]


def ref_sentencepiece(path):
    import sentencepiece as spm
    sp = spm.SentencePieceProcessor(model_file=path)
    return lambda texts: sp.encode(texts)


# name -> (tokenizer argument, reference factory, extra prepare-data flags)
CASES = {
    "tiktoken_gpt2": ("gpt2.tiktoken", lambda v: ref_tiktoken(os.path.join(v, "gpt2.tiktoken"), GPT2_PATTERN), []),
    "tiktoken_multilingual": ("multilingual.tiktoken",
                              lambda v: ref_tiktoken(os.path.join(v, "multilingual.tiktoken"), GPT2_PATTERN), []),
    "tekken": ("tekken_240718.json", lambda v: ref_tekken(os.path.join(v, "tekken_240718.json")), []),
    "gpt2_dir": ("gpt2", lambda v: ref_gpt2_dir(os.path.join(v, "gpt2")), []),
    "hf_gpt2": ("gpt2-hf/tokenizer.json", lambda v: ref_hf(os.path.join(v, "gpt2-hf/tokenizer.json")), []),
    "hf_split": ("gpt2-split-hf", lambda v: ref_hf(os.path.join(v, "gpt2-split-hf/tokenizer.json")), []),
    "hf_mistral_legacy": ("mistral-legacy-hf/tokenizer.json",
                          lambda v: ref_hf(os.path.join(v, "mistral-legacy-hf/tokenizer.json")), []),
    "hf_mistral_metaspace": ("mistral-metaspace-hf/tokenizer.json",
                             lambda v: ref_hf(os.path.join(v, "mistral-metaspace-hf/tokenizer.json")), []),
    "sentencepiece_v1": ("mistral-v1.model", lambda v: ref_sentencepiece(os.path.join(v, "mistral-v1.model")), []),
    "sentencepiece_v3": ("mistral-v3.model", lambda v: ref_sentencepiece(os.path.join(v, "mistral-v3.model")), []),
}

LANGS = ["ar", "be", "bg", "ca", "cs", "da", "de", "el", "eo", "es", "et", "eu", "fa", "fi", "fr", "ga", "gl", "he",
         "hi", "hr", "hu", "id", "it", "ja", "ka", "kk", "ko", "lt", "nb", "nl", "pl", "pt_BR", "ro", "ru", "sk", "sl",
         "sr", "sv", "ta", "th", "tr", "uk", "vi", "zh_CN", "zh_TW"]


# Catalogs of packages every Debian system has (essential or priority required).
CATALOGS = ["coreutils", "dpkg", "bash", "apt", "findutils", "diffutils", "grep", "sed", "tar", "gzip", "libc", "Linux-PAM",
            "util-linux", "shadow", "debconf", "adduser"]


def corpus_kjv(work):
    path = os.path.join(work, "kjv.txt")
    if not os.path.exists(path):
        text = subprocess.run(["bible", "-l100000", "Gen1:1-Rev22:21"], check=True, capture_output=True, text=True).stdout
        with open(path + ".tmp", "w") as f:
            f.write(text)
        os.replace(path + ".tmp", path)
    docs = [line + "\n" for line in open(path, encoding="utf-8").read().split("\n") if line.strip(" \t\r")]
    return [path], ["--split-lines"], docs


def corpus_licenses(work):
    files = sorted(p for p in glob.glob("/usr/share/common-licenses/*") if os.path.isfile(p))
    docs = [open(p, encoding="utf-8").read() for p in files]
    keep = [(p, d) for p, d in zip(files, docs) if d]
    return [p for p, _ in keep], [], [d for _, d in keep]


def corpus_multilingual(work):
    path = os.path.join(work, "multilingual.jsonl")
    texts = []
    for lang in LANGS:
        n = 0
        for mo in (f"/usr/share/locale/{lang}/LC_MESSAGES/{c}.mo" for c in CATALOGS):
            if n >= 600 or not os.path.exists(mo):
                continue
            try:
                with open(mo, "rb") as f:
                    cat = gettext.GNUTranslations(f)._catalog
            except Exception:
                continue
            for k, v in sorted(cat.items(), key=lambda kv: str(kv[0])):
                if isinstance(v, str) and v.strip() and k != "" and n < 600:
                    texts.append(v)
                    n += 1
    with open(path, "w", encoding="utf-8") as f:
        for t in texts:
            f.write(json.dumps({"text": t}, ensure_ascii=False) + "\n")
    return [path], ["--json-keys", "text"], texts


def corpus_edge(work):
    rng = random.Random(1234)
    ranges = [(0x20, 0x7E)] * 6 + [(0xA0, 0xFF), (0x300, 0x36F), (0x370, 0x3FF), (0x400, 0x4FF), (0x590, 0x5FF),
                                    (0x600, 0x6FF), (0x900, 0x97F), (0xE00, 0xE7F), (0x1100, 0x11FF), (0x2000, 0x206F),
                                    (0x3000, 0x30FF), (0x4E00, 0x9FFF), (0xAC00, 0xD7A3), (0x1F300, 0x1F6FF),
                                    (0x1D400, 0x1D7FF), (0xFF00, 0xFFEF)]
    pieces = ["'s", "'S", "'ll", "'LL", "'re", "'ve", "'m", "'d", " ", "  ", "   ", "\t", "\n", "\n\n", "\r\n", " \n ",
              "\u00a0", "\u3000", "123", "4567890", "3.14", "<s>", "</s>", "<unk>", "<|endoftext|>", "▁", "__", "...",
              "http://example.org/a?b=c", "CamelCaseWord", "ALLCAPS", "naïve café", "e\u0301", "İstanbul", "ǅ"]
    texts = []
    for _ in range(4000):
        parts = []
        for _ in range(rng.randint(1, 24)):
            if rng.random() < 0.35:
                parts.append(rng.choice(pieces))
            else:
                lo, hi = rng.choice(ranges)
                parts.append("".join(chr(rng.randint(lo, hi)) for _ in range(rng.randint(1, 8))))
        t = "".join(parts)
        t = "".join(c for c in t if not 0xD800 <= ord(c) <= 0xDFFF)
        if t.strip():
            texts.append(t)
    path = os.path.join(work, "edge.jsonl")
    with open(path, "w", encoding="utf-8") as f:
        for t in texts:
            f.write(json.dumps({"text": t}, ensure_ascii=False) + "\n")
    return [path], ["--json-keys", "text"], texts


CORPORA = {"kjv": corpus_kjv, "licenses": corpus_licenses, "multilingual": corpus_multilingual, "edge": corpus_edge}


def read_megatron(prefix):
    with open(prefix + ".idx", "rb") as f:
        assert f.read(9) == b"MMIDIDX\x00\x00"
        np.frombuffer(f.read(8), np.uint64)
        code = f.read(1)[0]
        n = int(np.frombuffer(f.read(8), np.uint64)[0])
        f.read(8)
        lengths = np.frombuffer(f.read(4 * n), np.int32)
    data = np.fromfile(prefix + ".bin", {8: np.uint16, 4: np.int32}[code])
    out, pos = [], 0
    for n_tok in lengths:
        out.append(data[pos:pos + n_tok].tolist())
        pos += int(n_tok)
    return out


def sabotaged(path, work):
    """A copy of a tokenizer.json with its first 5,000 merges in reverse order (mfsdp gets it, the
    reference the original): proof that the comparison sees a wrong tokenizer."""
    j = json.load(open(path, encoding="utf-8"))
    j["model"]["merges"][:5000] = j["model"]["merges"][:5000][::-1]
    out = os.path.join(work, "sabotaged.json")
    json.dump(j, open(out, "w", encoding="utf-8"), ensure_ascii=False)
    return out


def run_case(name, args):
    tok_arg, ref_factory, extra = CASES[name]
    encode = ref_factory(args.vocab)
    tok_path = os.path.join(args.vocab, tok_arg)
    if args.sabotage:
        tok_path = sabotaged(tok_path, args.work)
    failures = 0
    for cname, corpus in CORPORA.items():
        if args.corpora and cname not in args.corpora:
            continue
        inputs, flags, docs = corpus(args.work)
        prefix = os.path.join(args.work, f"{name}_{cname}")
        cmd = [args.mfsdp, "prepare-data", "-i", *inputs, "-o", prefix, "-t", tok_path,
               "--workers", str(args.workers), "--no-progress", *flags, *extra]
        t0 = time.time()
        p = subprocess.run(cmd, capture_output=True, text=True)
        t_mfsdp = time.time() - t0
        if p.returncode != 0:
            print(f"{name}/{cname}: prepare-data failed ({p.returncode}): {p.stderr.strip()}")
            failures += 1
            continue
        out_prefix = prefix + "_text_document" if "--json-keys" in flags else prefix
        got = read_megatron(out_prefix)
        t0 = time.time()
        want = [ids for ids in encode(docs) if ids]
        t_ref = time.time() - t0
        bad = [i for i, (g, w) in enumerate(zip(got, want)) if g != w]
        if len(got) != len(want):
            print(f"{name}/{cname}: {len(got)} documents written, the reference has {len(want)}")
            failures += 1
        if bad:
            i = bad[0]
            nonempty = [d for d, ids in zip(docs, encode(docs)) if ids]
            print(f"{name}/{cname}: {len(bad)} of {len(want)} documents differ; first: #{i} {nonempty[i][:200]!r}\n"
                  f"  mfsdp:     {got[i][:60]}\n  reference: {want[i][:60]}")
            failures += 1
        ntok = sum(len(w) for w in want)
        print(f"{name}/{cname}: {len(want)} documents, {ntok} tokens, {len(bad)} mismatches "
              f"(mfsdp {t_mfsdp:.2f} s, reference {t_ref:.2f} s)", flush=True)
    return failures


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mfsdp", required=True)
    ap.add_argument("--vocab", required=True)
    ap.add_argument("--work", required=True)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--corpora", nargs="*", choices=sorted(CORPORA), help="only these corpora")
    ap.add_argument("--sabotage", metavar="CASE", help="run CASE (a tokenizer.json case) with its merges reordered; "
                    "mismatches are expected")
    ap.add_argument("cases", nargs="*", help="cases: " + ", ".join(sorted(CASES)) + ", or all")
    args = ap.parse_args()
    if args.sabotage:
        args.cases, args.corpora = [args.sabotage], ["kjv"]
    unknown = [c for c in args.cases if c not in CASES and c != "all"]
    if unknown or not args.cases:
        ap.error(f"give cases from {', '.join(sorted(CASES))} or all (got {unknown or 'none'})")
    if not os.path.isdir(args.vocab):
        sys.exit(f"{args.vocab}: no vocabularies (run scripts/tokenizers/fetch_vocabularies.py {args.vocab})")
    os.makedirs(args.work, exist_ok=True)
    cases = sorted(CASES) if "all" in args.cases else args.cases
    failures = sum(run_case(c, args) for c in cases)
    print("FAILED" if failures else "OK: 0 mismatches")
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
