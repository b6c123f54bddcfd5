#!/usr/bin/env python3
"""prepare-data's inputs, outputs and errors (each check can fail; the script exits 1 if one does).

  prepare_checks.py --mfsdp BIN --vocab DIR --work DIR

  workers      --workers 1, 2 and 5 write byte-identical .bin/.idx files
  compressed   gzip (two concatenated members) and zstd inputs give the plain file's dataset
  jsonl_keys   two --json-keys give two datasets named PREFIX_<key>_document (Megatron's names)
  eod_bos      --append-eod appends the tokenizer's end of document; a tokenizer.json template's
               <s> is there; the byte tokenizer appends 256 by default; .meta.json records both
  dtype        a vocabulary of 131,072 (Tekken) writes int32, GPT-2's 50,257 uint16 (Megatron's rule)
  bad_json     a malformed JSON line stops the run naming file:line; nothing is written
  bad_key      a missing key and a non-string value name file:line and the key
  bad_utf8     invalid UTF-8 in a text file names file:line and the byte
  skip_bad     --skip-bad skips and counts those records and writes the rest
  bad_tokenizer  broken tokenizer files: file (and line) and what was expected
"""
import argparse
import filecmp
import gzip
import json
import os
import subprocess
import sys

import numpy as np

failures = []


def check(name, cond, detail=""):
    print(f"{'ok  ' if cond else 'FAIL'} {name}{': ' + detail if detail and not cond else ''}", flush=True)
    if not cond:
        failures.append(name)


def run(args, *cmd):
    p = subprocess.run([args.mfsdp, "prepare-data", "--no-progress", *cmd], capture_output=True, text=True)
    return p.returncode, p.stdout + p.stderr


def tokens(prefix):
    with open(prefix + ".idx", "rb") as f:
        f.seek(17)
        code = f.read(1)[0]
    return np.fromfile(prefix + ".bin", {8: np.uint16, 4: np.int32}[code]), code


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--mfsdp", required=True)
    ap.add_argument("--vocab", required=True)
    ap.add_argument("--work", required=True)
    args = ap.parse_args()
    w = args.work
    os.makedirs(w, exist_ok=True)
    gpt2 = os.path.join(args.vocab, "gpt2")

    # A corpus of mixed documents, large enough for several chunks per worker.
    lines = []
    for i in range(30000):
        lines.append(json.dumps({"text": f"Document {i}: the quick brown fox {'jumps ' * (i % 7)}über naïve 東京 {i * 7919}",
                                 "title": f"T{i}"}, ensure_ascii=False))
    jl = os.path.join(w, "c.jsonl")
    open(jl, "w").write("\n".join(lines) + "\n")

    # workers
    outs = []
    for n in (1, 2, 5):
        rc, msg = run(args, "-i", jl, "-o", f"{w}/wk{n}", "-t", gpt2, "--workers", str(n))
        check(f"workers: --workers {n} runs", rc == 0, msg)
        outs.append(f"{w}/wk{n}_text_document")
    same = all(filecmp.cmp(outs[0] + ext, o + ext, shallow=False) for o in outs[1:] for ext in (".bin", ".idx"))
    check("workers: 1, 2 and 5 workers write identical files", same)

    # compressed
    data = open(jl, "rb").read()
    half = len(data) // 2
    half = data.index(b"\n", half) + 1
    with open(f"{w}/c2.jsonl.gz", "wb") as f:
        f.write(gzip.compress(data[:half]) + gzip.compress(data[half:]))
    subprocess.run(["zstd", "-q", "-f", jl, "-o", f"{w}/c3.jsonl.zst"], check=True)
    for name, path in (("gzip", f"{w}/c2.jsonl.gz"), ("zstd", f"{w}/c3.jsonl.zst")):
        rc, msg = run(args, "-i", path, "-o", f"{w}/{name}", "-t", gpt2)
        ok = rc == 0 and all(filecmp.cmp(outs[0] + e, f"{w}/{name}_text_document" + e, shallow=False) for e in (".bin", ".idx"))
        check(f"compressed: {name} input equals the plain file's dataset", ok, msg)
    open(f"{w}/trunc.jsonl.gz", "wb").write(gzip.compress(data)[:5000])
    rc, msg = run(args, "-i", f"{w}/trunc.jsonl.gz", "-o", f"{w}/trunc", "-t", gpt2)
    check("compressed: a truncated .gz is an error naming it", rc == 2 and "trunc.jsonl.gz: truncated gzip" in msg, msg)

    # jsonl_keys
    rc, msg = run(args, "-i", jl, "-o", f"{w}/keys", "-t", gpt2, "--json-keys", "text", "title")
    check("jsonl_keys: two keys", rc == 0 and os.path.exists(f"{w}/keys_title_document.idx")
          and os.path.exists(f"{w}/keys_text_document.idx"), msg)
    if rc == 0:
        t, _ = tokens(f"{w}/keys_title_document")
        check("jsonl_keys: the title dataset holds the titles", t[:2].tolist() == [51, 15] , str(t[:4]))

    # eod_bos
    txt = os.path.join(w, "two.txt")
    open(txt, "w").write("Hello world\nSecond line\n")
    rc, msg = run(args, "-i", txt, "-o", f"{w}/eod", "-t", gpt2, "--split-lines", "--append-eod")
    t, _ = tokens(f"{w}/eod")
    check("eod_bos: --append-eod appends <|endoftext|> (50256)", rc == 0 and t.tolist() == [15496, 995, 198, 50256, 12211, 1627, 198, 50256], f"{msg} {t}")
    rc, msg = run(args, "-i", txt, "-o", f"{w}/bos", "-t", os.path.join(args.vocab, "mistral-legacy-hf"), "--split-lines", "--append-eod")
    t, _ = tokens(f"{w}/bos")
    meta = json.load(open(f"{w}/bos.meta.json")) if rc == 0 else {}
    check("eod_bos: the template's <s> (1) leads and </s> (2) ends each document",
          rc == 0 and t[0] == 1 and t[-1] == 2 and (t == 1).sum() == 2 and (t == 2).sum() == 2, f"{msg} {t}")
    check("eod_bos: .meta.json records the vocabulary and end of document",
          meta.get("vocab_size") == 32000 and meta.get("eod") == 2 and meta.get("bos") == 1, str(meta))
    rc, msg = run(args, "-i", txt, "-o", f"{w}/byte", "--split-lines")
    t, _ = tokens(f"{w}/byte")
    check("eod_bos: the byte tokenizer ends documents with 256", rc == 0 and t[11] == 10 and t[12] == 256 and t[-1] == 256, str(t))

    rc, msg = run(args, "-i", txt, "-o", f"{w}/eodtok", "-t", gpt2, "--split-lines", "--append-eod", "--eod-token", "Hello")
    t, _ = tokens(f"{w}/eodtok")
    check("eod_bos: --eod-token chooses the end-of-document token (Hello = 15496)", rc == 0 and t[3] == 15496 and t[-1] == 15496,
          f"{msg} {t}")
    p = subprocess.run([args.mfsdp, "prepare-data", "--progress", "-i", txt, "-o", f"{w}/prog", "-t", gpt2],
                       capture_output=True, text=True)
    check("progress: --progress draws the line when stderr is not a terminal",
          p.returncode == 0 and "prepare-data: 1 documents" in p.stderr, p.stderr)
    rc, msg = run(args, "-i", txt, "-o", f"{w}/noprog", "-t", gpt2)
    check("progress: --no-progress draws none", rc == 0 and "MB/s)" not in msg.split("tokenizer ")[0], msg)

    # dtype
    rc, msg = run(args, "-i", txt, "-o", f"{w}/tk", "-t", os.path.join(args.vocab, "tekken_240718.json"))
    _, code = tokens(f"{w}/tk")
    check("dtype: 131,072 ids are int32", rc == 0 and code == 4, msg)
    _, code = tokens(f"{w}/eod")
    check("dtype: 50,257 ids are uint16", code == 8)

    # bad_json
    bad = lines[:5000] + ['{"text": "unterminated'] + lines[5000:6000]
    open(f"{w}/bad.jsonl", "w").write("\n".join(bad) + "\n")
    rc, msg = run(args, "-i", f"{w}/bad.jsonl", "-o", f"{w}/bad", "-t", gpt2, "--workers", "2")
    check("bad_json: names file and line 5001", rc == 2 and "bad.jsonl:5001: invalid JSON" in msg, msg)
    check("bad_json: nothing written", not any(os.path.exists(f"{w}/bad_text_document{e}") for e in (".bin", ".idx", ".bin.tmp", ".idx.tmp")))

    open(f"{w}/bignum.jsonl", "w").write('{"text": "a"}\n{"text": "b", "n": 1e99999}\n')
    rc, msg = run(args, "-i", f"{w}/bignum.jsonl", "-o", f"{w}/bignum", "-t", gpt2)
    check("bad_json: a number out of range names file:line (found by the fuzzer)",
          rc == 2 and "bignum.jsonl:2: invalid JSON" in msg, msg)

    # bad_key
    open(f"{w}/nokey.jsonl", "w").write('{"text": "a"}\n{"body": "b"}\n')
    rc, msg = run(args, "-i", f"{w}/nokey.jsonl", "-o", f"{w}/nokey", "-t", gpt2)
    check("bad_key: a missing key names file:line and the key", rc == 2 and 'nokey.jsonl:2: no key "text"' in msg, msg)
    open(f"{w}/numkey.jsonl", "w").write('{"text": "a"}\n\n{"text": 5}\n')
    rc, msg = run(args, "-i", f"{w}/numkey.jsonl", "-o", f"{w}/numkey", "-t", gpt2)
    check("bad_key: a non-string value names file:line", rc == 2 and 'numkey.jsonl:3: key "text" is a number' in msg, msg)

    # bad_utf8
    open(f"{w}/u.txt", "wb").write(b"fine line\nsecond \xff line\nthird\n")
    rc, msg = run(args, "-i", f"{w}/u.txt", "-o", f"{w}/u", "-t", gpt2, "--split-lines")
    check("bad_utf8: names file:line and the byte", rc == 2 and "u.txt:2: invalid UTF-8 (byte 0xFF at column 8)" in msg, msg)
    rc, msg = run(args, "-i", f"{w}/u.txt", "-o", f"{w}/u", "-t", gpt2)
    check("bad_utf8: in a whole-file document too", rc == 2 and "u.txt:2: invalid UTF-8" in msg, msg)

    # skip_bad
    rc, msg = run(args, "-i", f"{w}/bad.jsonl", "-o", f"{w}/skip", "-t", gpt2, "--skip-bad")
    idx_ok = rc == 0 and "1 skipped as bad" in msg
    check("skip_bad: skips and counts", idx_ok, msg)
    if idx_ok:
        with open(f"{w}/skip_text_document.idx", "rb") as f:
            f.seek(18)
            n = int(np.frombuffer(f.read(8), np.uint64)[0])
        check("skip_bad: the other 6000 documents are written", n == 6000, str(n))

    # bad_tokenizer
    open(f"{w}/broken.json", "w").write('{\n  "model": {\n    "type": "BPE",\n    "vocab": {"a": 0,,}\n}\n')
    rc, msg = run(args, "-i", txt, "-o", f"{w}/bt", "-t", f"{w}/broken.json")
    check("bad_tokenizer: invalid tokenizer.json names its line", rc == 2 and "broken.json:4: not valid JSON" in msg, msg)
    open(f"{w}/wp.json", "w").write(json.dumps({"model": {"type": "WordPiece", "vocab": {}}}))
    rc, msg = run(args, "-i", txt, "-o", f"{w}/bt", "-t", f"{w}/wp.json")
    check("bad_tokenizer: an unsupported model type is named", rc == 2 and 'model.type "WordPiece" is not supported' in msg, msg)
    open(f"{w}/bad.tiktoken", "w").write("SGVsbG8= 0\nnot-base64!! 1\n")
    rc, msg = run(args, "-i", txt, "-o", f"{w}/bt", "-t", f"{w}/bad.tiktoken", "--tiktoken-encoding", "cl100k_base")
    check("bad_tokenizer: a bad rank line names file:line", rc == 2 and "bad.tiktoken:2: expected" in msg, msg)
    rc, msg = run(args, "-i", txt, "-o", f"{w}/bt", "-t", f"{w}/bad.tiktoken")
    check("bad_tokenizer: a rank file without a known name asks for --tiktoken-encoding", rc == 2 and "--tiktoken-encoding" in msg, msg)
    rc, msg = run(args, "-i", txt, "-o", f"{w}/bt", "-t", f"{w}/nothing-here")
    check("bad_tokenizer: a missing path", rc == 2 and "nothing-here: no such tokenizer" in msg, msg)
    open(f"{w}/junk.model", "wb").write(b"\x00\x01junk")
    rc, msg = run(args, "-i", txt, "-o", f"{w}/bt", "-t", f"{w}/junk.model")
    check("bad_tokenizer: a corrupt .model", rc == 2 and "junk.model: not a SentencePiece model" in msg, msg)
    check("bad_tokenizer: nothing written", not any(os.path.exists(f"{w}/bt{e}") for e in (".bin", ".idx", ".bin.tmp")))

    print("FAILED: " + ", ".join(failures) if failures else "all prepare-data checks passed")
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
