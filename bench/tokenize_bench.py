#!/usr/bin/env python3
"""Tokenizer throughput: mfsdp prepare-data against Hugging Face tokenizers (Rust) and tiktoken,
side by side in one run, on the same documents and thread counts.

  .venv/bin/python bench/tokenize_bench.py [--mfsdp build/bin/mfsdp] [--vocab .cache/vocab]
                                           [--mb 24] [--threads 1 2] [--out bench/results_tokenize.md]

Corpus: the KJV (one document per verse) and the multilingual .mo messages of
tests/tokenizer/check_tokenizers.py, repeated to about --mb MB, as one JSONL file.
  mfsdp      `prepare-data --workers N` end to end: read the JSONL, parse it, validate UTF-8,
             tokenize, write .bin/.idx; its own elapsed time (the summary line; process start-up
             and LibTorch loading excluded) and the wall time of the whole command.
  tokenizers Tokenizer.from_file(tokenizer.json).encode_batch(texts) and encode_batch_fast(texts)
             (no offsets: its fastest path) with RAYON_NUM_THREADS=N: the texts already in
             memory, so JSON parsing and writing are not in its time.
  tiktoken   Encoding.encode_ordinary_batch(texts, num_threads=N), also from memory.
Each is the best of --repeat runs. Ratios > 1 mean mfsdp is faster.
"""
import argparse
import datetime
import json
import os
import platform
import re
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests", "tokenizer"))
import check_tokenizers as ct  # noqa: E402

CASES = [  # (label, tokenizer argument, tokenizer.json for `tokenizers`, tiktoken file)
    ("GPT-2 byte-level BPE", "gpt2-hf/tokenizer.json", "gpt2-hf/tokenizer.json", "gpt2.tiktoken"),
    ("Mistral byte-fallback BPE", "mistral-metaspace-hf/tokenizer.json", "mistral-metaspace-hf/tokenizer.json", None),
    ("Tekken (tiktoken, 131k)", "tekken_240718.json", None, "tekken"),
]


def corpus(work, mb):
    path = os.path.join(work, f"bench_{mb}mb.jsonl")
    _, _, kjv = ct.corpus_kjv(work)
    _, _, ml = ct.corpus_multilingual(work)
    base = kjv + ml
    texts, size = [], 0
    while size < mb * 1e6:
        for t in base:
            texts.append(t)
            size += len(t.encode("utf-8"))
            if size >= mb * 1e6:
                break
    with open(path, "w", encoding="utf-8") as f:
        for t in texts:
            f.write(json.dumps({"text": t}, ensure_ascii=False) + "\n")
    return path, texts, size


def best(fn, repeat):
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mfsdp", default=os.path.join(HERE, "..", "build", "bin", "mfsdp"))
    ap.add_argument("--vocab", default=os.path.join(HERE, "..", ".cache", "vocab"))
    ap.add_argument("--work", default="/tmp/mfsdp_tokbench")
    ap.add_argument("--mb", type=float, default=24)
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--out", default=os.path.join(HERE, "results_tokenize.md"))
    args = ap.parse_args()
    os.makedirs(args.work, exist_ok=True)
    path, texts, size = corpus(args.work, args.mb)
    mb = size / 1e6
    rows = []
    for label, tok_arg, hf_json, tk in CASES:
        for n in args.threads:
            def run_mfsdp():
                p = subprocess.run([args.mfsdp, "prepare-data", "-i", path, "-o", os.path.join(args.work, "out"), "-t",
                                    os.path.join(args.vocab, tok_arg), "--workers", str(n), "--no-progress"],
                                   capture_output=True, text=True, check=True)
                return float(re.search(r"MB in ([0-9.]+) s", p.stdout).group(1))
            inner, wall = [], []
            for _ in range(args.repeat):
                t0 = time.perf_counter()
                inner.append(run_mfsdp())
                wall.append(time.perf_counter() - t0)
            row = {"case": label, "threads": n, "mfsdp": mb / min(inner), "mfsdp_wall": mb / min(wall)}
            if hf_json:
                code = (f"import os,time,json\nfrom tokenizers import Tokenizer\nt=Tokenizer.from_file({os.path.join(args.vocab, hf_json)!r})\n"
                        f"texts=[json.loads(l)['text'] for l in open({path!r},encoding='utf-8')]\nbest=1e9\n"
                        f"for _ in range({args.repeat}):\n t0=time.perf_counter(); t.encode_batch(texts); best=min(best,time.perf_counter()-t0)\n"
                        f"fast=1e9\nfor _ in range({args.repeat}):\n t0=time.perf_counter(); t.encode_batch_fast(texts); fast=min(fast,time.perf_counter()-t0)\n"
                        f"print(best, fast)")
                env = dict(os.environ, RAYON_NUM_THREADS=str(n), TOKENIZERS_PARALLELISM="true")
                slow, fast = map(float, subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                                                       text=True, check=True).stdout.split())
                row["tokenizers"], row["tokenizers_fast"] = mb / slow, mb / fast
            if tk:
                enc = (ct.ref_tiktoken(os.path.join(args.vocab, tk), ct.GPT2_PATTERN) if tk != "tekken"
                       else ct.ref_tekken(os.path.join(args.vocab, "tekken_240718.json")))
                import tiktoken  # noqa: F401
                # ref_* use two threads; rebuild with n threads for the measurement.
                if tk == "tekken":
                    d = json.load(open(os.path.join(args.vocab, "tekken_240718.json")))
                    cfg = d["config"]
                    inner_v = cfg["default_vocab_size"] - cfg["default_num_special_tokens"]
                    import base64
                    ranks = {base64.b64decode(v["token_bytes"]): v["rank"] for v in d["vocab"][:inner_v]}
                    e = tiktoken.Encoding("tekken", pat_str=cfg["pattern"], mergeable_ranks=ranks, special_tokens={})
                else:
                    e = tiktoken.Encoding("gpt2", pat_str=ct.GPT2_PATTERN,
                                          mergeable_ranks=ct.load_ranks(os.path.join(args.vocab, tk)), special_tokens={})
                row["tiktoken"] = mb / best(lambda: e.encode_ordinary_batch(texts, num_threads=n), args.repeat)
            rows.append(row)
            print(json.dumps(row), flush=True)

    cpu = "unknown"
    try:
        cpu = next(l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name"))
    except Exception:
        pass
    lines = [
        "# Tokenizer throughput: mfsdp prepare-data vs Hugging Face tokenizers and tiktoken",
        "",
        f"Date: {datetime.date.today()}. Machine: {cpu}, {os.cpu_count()} cores, {platform.system()} {platform.release()}.",
        f"Command: `.venv/bin/python bench/tokenize_bench.py --mb {args.mb:g} --threads {' '.join(map(str, args.threads))}`",
        f"Corpus: {len(texts)} documents, {mb:.1f} MB of UTF-8 (KJV verses + .mo messages of ~45 languages), one JSONL file.",
        "",
        "MB/s of input text, best of %d. mfsdp: prepare-data's own elapsed time for the whole job (read, JSON parse, "
        "UTF-8 check, tokenize, write); mfsdp (wall): the command including process start-up. tokenizers and "
        "tiktoken: encoding texts already in memory (no parsing, no writing). Ratio: mfsdp / reference." % args.repeat,
        "",
        "| tokenizer | threads | mfsdp | mfsdp (wall) | tokenizers encode_batch | ratio | tokenizers encode_batch_fast | ratio | tiktoken | ratio |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        f = lambda k: f"{r[k]:.2f}" if k in r else "-"
        ratio = lambda k: f"{r['mfsdp'] / r[k]:.2f}x" if k in r else "-"
        lines.append(f"| {r['case']} | {r['threads']} | {f('mfsdp')} | {f('mfsdp_wall')} | {f('tokenizers')} | "
                     f"{ratio('tokenizers')} | {f('tokenizers_fast')} | {ratio('tokenizers_fast')} | {f('tiktoken')} | "
                     f"{ratio('tiktoken')} |")
    with open(args.out, "w") as fo:
        fo.write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
