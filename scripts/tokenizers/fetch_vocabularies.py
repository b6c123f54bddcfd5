#!/usr/bin/env python3
"""Genuine tokenizer vocabularies from PyPI (no model hub needed), for the tests and the demo.

  python scripts/tokenizers/fetch_vocabularies.py [DIR]     # default .cache/vocab

Downloads two pinned packages with pip (no install) and takes their data files out, each checked
against its SHA-256:
  openai-whisper 20250625 (sdist): whisper/assets/gpt2.tiktoken        GPT-2's BPE (50,256 ranks)
                                   whisper/assets/multilingual.tiktoken Whisper's multilingual BPE
  mistral_common 1.13.1 (wheel):   data/tokenizer.model.v1              Mistral 7B v0.1 SentencePiece
                                   data/mistral_instruct_tokenizer_240323.model.v3   (v3, 32,768)
                                   data/tekken_240718.json              Tekken (Mistral Nemo, 131,072)
and writes, from those, the other formats users bring, the way their own tools make them:
  gpt2/vocab.json + merges.txt     GPT-2's encoder.json / vocab.bpe: the ranks' bytes in GPT-2's
                                   printable-byte alphabet, each merge found by running BPE over the
                                   token with the lower ranks only (as transformers' TikTokenConverter)
  gpt2-hf/tokenizer.json           what GPT2TokenizerFast saves: ByteLevel + BPE + <|endoftext|>
  gpt2-split-hf/tokenizer.json     the Llama 3 / Qwen layout on GPT-2's vocabulary: Split(cl100k's
                                   pattern, Isolated) + ByteLevel(use_regex=false), ignore_merges
  mistral-legacy-hf/tokenizer.json transformers' LlamaConverter of tokenizer.model.v1 (legacy):
                                   Prepend("▁") + Replace(" ", "▁") normalizer, byte-fallback BPE,
                                   <s> template
  mistral-metaspace-hf/tokenizer.json  the same vocabulary, non-legacy: Metaspace(prepend_scheme
                                   "first", split false), no normalizer
The derived files are written by the tokenizers library itself (Tokenizer.save).
Idempotent: files already there with the right hash are kept.
"""
import hashlib
import io
import json
import os
import subprocess
import sys
import tarfile
import tempfile
import zipfile

SOURCES = {
    "openai-whisper==20250625": ("openai_whisper-20250625.tar.gz", {
        "openai_whisper-20250625/whisper/assets/gpt2.tiktoken":
            ("gpt2.tiktoken", "306cd27f03c1a714eca7108e03d66b7dc042abe8c258b44c199a7ed9838dd930"),
        "openai_whisper-20250625/whisper/assets/multilingual.tiktoken":
            ("multilingual.tiktoken", "b34b360dbb493e781e479794586d661700670d65564001f23024971d1f2fa126"),
    }),
    "mistral_common==1.13.1": ("mistral_common-1.13.1-py3-none-any.whl", {
        "mistral_common/data/tokenizer.model.v1":
            ("mistral-v1.model", "dadfd56d766715c61d2ef780a525ab43b8e6da4de6865bda3d95fdef5e134055"),
        "mistral_common/data/mistral_instruct_tokenizer_240323.model.v3":
            ("mistral-v3.model", "9addc8bdce5988448ae81b729336f43a81262160ae8da760674badab9d4c7d33"),
        "mistral_common/data/tekken_240718.json":
            ("tekken_240718.json", "eccd1665d2e477697c33cb7f0daa6f6dfefc57a0a6bceb66d4be52952f827516"),
    }),
}

GPT2_PATTERN = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
CL100K_PATTERN = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
                  r"""|\s*[\r\n]+|\s+(?!\S)|\s+""")


def sha256(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def fetch(out):
    for spec, (archive, members) in SOURCES.items():
        if all(os.path.exists(os.path.join(out, n)) and sha256(os.path.join(out, n)) == h for n, h in members.values()):
            continue
        with tempfile.TemporaryDirectory() as tmp:
            print(f"fetch_vocabularies: pip download {spec}", flush=True)
            subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--no-binary" if archive.endswith(".tar.gz") else "--only-binary",
                            ":all:", "-d", tmp, spec], check=True)
            path = os.path.join(tmp, archive)
            if archive.endswith(".whl"):
                with zipfile.ZipFile(path) as z:
                    data = {m: z.read(m) for m in members}
            else:
                with tarfile.open(path) as t:
                    data = {m: t.extractfile(m).read() for m in members}
        for m, (name, want) in members.items():
            got = hashlib.sha256(data[m]).hexdigest()
            if got != want:
                sys.exit(f"fetch_vocabularies: {spec}:{m}: SHA-256 {got}, expected {want}")
            tmp_path = os.path.join(out, name + ".tmp")
            with open(tmp_path, "wb") as f:
                f.write(data[m])
            os.replace(tmp_path, os.path.join(out, name))


def bytes_to_unicode():
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    table, n = {}, 0
    for b in range(256):
        if b in keep:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + n)
            n += 1
    return table


def load_ranks(path):
    import base64
    ranks = {}
    with open(path, "rb") as f:
        for line in f:
            if line.strip():
                tok, rank = line.split()
                ranks[base64.b64decode(tok)] = int(rank)
    return ranks


def bpe_parts(ranks, token, max_rank):
    parts = [bytes([b]) for b in token]
    while True:
        best = None
        for i in range(len(parts) - 1):
            r = ranks.get(parts[i] + parts[i + 1])
            if r is not None and r < max_rank and (best is None or r < best[0]):
                best = (r, i)
        if best is None:
            return parts
        i = best[1]
        parts[i:i + 2] = [parts[i] + parts[i + 1]]


def write_gpt2(out):
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors
    d = os.path.join(out, "gpt2")
    os.makedirs(d, exist_ok=True)
    if not (os.path.exists(os.path.join(d, "vocab.json")) and os.path.exists(os.path.join(d, "merges.txt"))):
        ranks = load_ranks(os.path.join(out, "gpt2.tiktoken"))
        b2u = bytes_to_unicode()
        enc = lambda b: "".join(b2u[x] for x in b)
        vocab = {enc(tok): r for tok, r in ranks.items()}
        vocab["<|endoftext|>"] = len(ranks)
        merges = []
        for tok, r in sorted(ranks.items(), key=lambda kv: kv[1]):
            if len(tok) == 1:
                continue
            parts = bpe_parts(ranks, tok, r)
            assert len(parts) == 2, (tok, parts)
            merges.append(f"{enc(parts[0])} {enc(parts[1])}")
        with open(os.path.join(d, "vocab.json"), "w", encoding="utf-8") as f:
            json.dump(vocab, f, ensure_ascii=False)
        with open(os.path.join(d, "merges.txt"), "w", encoding="utf-8") as f:
            f.write("#version: 0.2\n" + "\n".join(merges) + "\n")
    vocab_file, merges_file = os.path.join(d, "vocab.json"), os.path.join(d, "merges.txt")
    for name, split in (("gpt2-hf", False), ("gpt2-split-hf", True)):
        path = os.path.join(out, name, "tokenizer.json")
        if os.path.exists(path):
            continue
        os.makedirs(os.path.dirname(path), exist_ok=True)
        if split:
            t = Tokenizer(models.BPE.from_file(vocab_file, merges_file, ignore_merges=True))
            t.pre_tokenizer = pre_tokenizers.Sequence([
                pre_tokenizers.Split(pattern=__import__("tokenizers").Regex(CL100K_PATTERN), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
        else:
            t = Tokenizer(models.BPE.from_file(vocab_file, merges_file))
            t.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        t.decoder = decoders.ByteLevel()
        t.post_processor = processors.ByteLevel(trim_offsets=False)
        t.add_special_tokens([AddedToken("<|endoftext|>", special=True, normalized=False)])
        t.save(path)


def write_mistral(out):
    import sentencepiece as spm
    from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors
    want = [os.path.join(out, n, "tokenizer.json") for n in ("mistral-legacy-hf", "mistral-metaspace-hf")]
    if all(os.path.exists(p) for p in want):
        return
    sp = spm.SentencePieceProcessor(model_file=os.path.join(out, "mistral-v1.model"))
    vocab = {sp.id_to_piece(i): i for i in range(sp.get_piece_size())}
    scores = {sp.id_to_piece(i): sp.get_score(i) for i in range(sp.get_piece_size())}
    # transformers' SentencePieceExtractor: every split of every piece into two pieces, ordered by
    # the merged piece's score (higher first), then by the parts' ids.
    merges = []
    for piece, score in scores.items():
        local = [(piece[:i], piece[i:], score) for i in range(1, len(piece)) if piece[:i] in vocab and piece[i:] in vocab]
        merges.extend(sorted(local, key=lambda x: (vocab[x[0]], vocab[x[1]])))
    merges = [(a, b) for a, b, _ in sorted(merges, key=lambda m: m[2], reverse=True)]
    for path, legacy in zip(want, (True, False)):
        os.makedirs(os.path.dirname(path), exist_ok=True)
        t = Tokenizer(models.BPE(vocab, merges, unk_token="<unk>", fuse_unk=True, byte_fallback=True))
        t.add_special_tokens([AddedToken(sp.id_to_piece(i), special=True, normalized=False) for i in (0, 1, 2)])
        if legacy:
            t.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
        else:
            t.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first", split=False)
        t.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)])
        t.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", 1)])
        t.save(path)


def main():
    out = sys.argv[1] if len(sys.argv) > 1 else ".cache/vocab"
    os.makedirs(out, exist_ok=True)
    fetch(out)
    write_gpt2(out)
    write_mistral(out)
    print(f"fetch_vocabularies: genuine vocabularies in {out}")


if __name__ == "__main__":
    main()
