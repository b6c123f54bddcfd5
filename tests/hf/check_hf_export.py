#!/usr/bin/env python3
"""`mfsdp export --format hf` loads in transformers with mfsdp's logits (tests/hf/hf_tests.cmake).

    check_hf_export.py --mfsdp BIN --checkpoint CKPT_DIR --work DIR [--max-shard-size S] [--expect-shards N]

Exports the checkpoint twice: as a Hugging Face directory (--format hf) and as the trained
TorchScript model (--format torchscript, the weights in mfsdp's own model). Then
AutoModelForCausalLM.from_pretrained(DIR) (local files only) must load with no missing, unexpected
or mismatched keys, and its logits on a batch must equal the TorchScript model's within 1e-5
relative (max |a-b| / max |b|). With --expect-shards N the directory must hold N safetensors shards
and a model.safetensors.index.json naming every tensor. With --lora (a PEFT LoRA model's checkpoint)
the directory holds the merged model, and `export --only-trainable --format hf` writes the adapter
directory, which peft's PeftModel.from_pretrained must load onto the base weights (every adapter
tensor equal to the trained one) with the same logits within 1e-5; the trained adapters must have
moved off their start (lora_B starts at zero). Exit 1 on any failed check.
"""
import argparse
import glob
import json
import os
import shutil
import subprocess
import sys

import torch

# mfsdp's TorchScript operators (mfsdp::attention in exports of eager-attention families), so that
# torch.jit.load reads every file mfsdp trains.
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "scripts"))
import mfsdp_ops  # noqa: E402,F401


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--mfsdp", required=True)
    ap.add_argument("--checkpoint", required=True)
    ap.add_argument("--work", required=True)
    ap.add_argument("--max-shard-size")
    ap.add_argument("--expect-shards", type=int, default=1)
    ap.add_argument("--dtype")
    ap.add_argument("--lora", action="store_true")
    a = ap.parse_args()
    shutil.rmtree(a.work, ignore_errors=True)
    os.makedirs(a.work)
    out, ts = os.path.join(a.work, "hf"), os.path.join(a.work, "trained.pt")
    cmd = [a.mfsdp, "export", "--checkpoint", a.checkpoint, "--format", "hf", "--out", out]
    if a.max_shard_size:
        cmd += ["--max-shard-size", a.max_shard_size]
    if a.dtype:
        cmd += ["--dtype", a.dtype]
    for c in (cmd, [a.mfsdp, "export", "--checkpoint", a.checkpoint, "--format", "torchscript", "--out", ts]):
        p = subprocess.run(c, capture_output=True, text=True)
        print(p.stdout.strip())
        if p.returncode != 0:
            sys.exit(f"FAIL: {' '.join(c)}: exit {p.returncode}\n{p.stderr}")
    failures = []

    def check(what, ok, detail=""):
        print(f"{'ok  ' if ok else 'FAIL'} {what}{': ' + detail if detail else ''}")
        if not ok:
            failures.append(what)

    shards = sorted(glob.glob(os.path.join(out, "*.safetensors")))
    check(f"{len(shards)} safetensors file(s), {a.expect_shards} expected", len(shards) == a.expect_shards,
          ", ".join(os.path.basename(s) for s in shards))
    if a.expect_shards > 1:
        idx = json.load(open(os.path.join(out, "model.safetensors.index.json")))
        from safetensors import safe_open
        names = set()
        for s in shards:
            with safe_open(s, "pt") as f:
                names |= set(f.keys())
        check("the index names every tensor of the shards, each in its file",
              set(idx["weight_map"]) == names and set(idx["weight_map"].values()) == {os.path.basename(s) for s in shards})

    import transformers
    from transformers import AutoModelForCausalLM
    transformers.logging.set_verbosity_error()
    model, info = AutoModelForCausalLM.from_pretrained(out, local_files_only=True, output_loading_info=True,
                                                       dtype=torch.float32)
    bad = {k: v for k, v in info.items() if v and k != "error_msgs"} | ({"error_msgs": info["error_msgs"]} if info.get("error_msgs") else {})
    check("from_pretrained loads it: no missing, unexpected or mismatched keys", not bad, str(bad)[:500])
    model.eval()
    mine = torch.jit.load(ts, map_location="cpu").eval()
    V = model.config.vocab_size
    g = torch.Generator().manual_seed(7)
    tokens = torch.randint(0, V, (2, 24), generator=g)
    pos = torch.arange(24).unsqueeze(0).expand(2, 24).contiguous()
    with torch.no_grad():
        want = mine(tokens, pos).float()
        got = model(input_ids=tokens, position_ids=pos, use_cache=False).logits.float()
    rel = float((got - want).abs().max() / want.abs().max())
    tol = 1e-5 if not a.dtype or a.dtype in ("float32", "fp32") else 2e-2
    check(f"logits of the exported directory equal mfsdp's trained model's (max relative {rel:.2e}, tolerance {tol:g})",
          rel <= tol)
    # The names save_pretrained writes for this model (a LoRA model's merged export too): the
    # family's checkpoint layout (Mixtral's per-expert block_sparse_moe tensors, not the stacked
    # mlp.experts the model holds).
    import tempfile
    from safetensors import safe_open
    mine_names = set()
    for s in shards:
        with safe_open(s, "pt") as f:
            mine_names |= set(f.keys())
    with tempfile.TemporaryDirectory() as tmp:
        model.save_pretrained(tmp)
        theirs = set()
        for s in glob.glob(os.path.join(tmp, "*.safetensors")):
            with safe_open(s, "pt") as f:
                theirs |= set(f.keys())
    check(f"the tensors are those save_pretrained writes ({len(theirs)})", mine_names == theirs,
          f"only mfsdp's: {sorted(mine_names - theirs)[:3]}, only save_pretrained's: {sorted(theirs - mine_names)[:3]}")
    cfg = json.load(open(os.path.join(out, "config.json")))
    check("config.json records the checkpoint and step", "mfsdp" in cfg and "step" in cfg["mfsdp"], str(cfg.get("mfsdp")))
    if a.lora:
        check_adapter(a, model, mine, tokens, pos, want, check)
    print("FAILED: " + "; ".join(failures) if failures else "all checks passed")
    sys.exit(1 if failures else 0)


def check_adapter(a, merged, mine, tokens, pos, want, check):
    import peft
    from safetensors.torch import load_file
    adir = os.path.join(a.work, "adapter")
    # A shard size below the adapters' size: PEFT reads one adapter_model.safetensors, never shards.
    c = [a.mfsdp, "export", "--checkpoint", a.checkpoint, "--format", "hf", "--only-trainable", "--max-shard-size", "1KB",
         "--out", adir]
    p = subprocess.run(c, capture_output=True, text=True)
    print(p.stdout.strip())
    if p.returncode != 0:
        sys.exit(f"FAIL: {' '.join(c)}: exit {p.returncode}\n{p.stderr}")
    check("the adapter directory holds PEFT's two files",
          sorted(os.listdir(adir)) == ["adapter_config.json", "adapter_model.safetensors"], str(sorted(os.listdir(adir))))
    trained = dict(mine.named_parameters())
    # The adapters and PEFT's modules_to_save copies (X.modules_to_save.default.*): what trained.
    lora = {n: t for n, t in trained.items() if ".lora_" in n or ".modules_to_save." in n}
    # The base model: transformers' own class with the trained file's base weights (frozen, so the
    # exported ones), the adapters loaded by peft onto it.
    base = type(merged)(merged.config).eval()
    sd = {}
    for n, t in trained.items():
        if ".lora_" in n or ".modules_to_save." in n:
            continue
        sd[n.removeprefix("base_model.model.").replace(".base_layer.", ".").replace(".original_module.", ".")] = t.detach()
    missing, unexpected = base.load_state_dict(sd, strict=False)
    missing = [m for m in missing if not (m.endswith("lm_head.weight") and merged.config.tie_word_embeddings)]
    check("the base weights fit the transformers model", not missing and not unexpected, f"{missing[:3]} {unexpected[:3]}")
    pm = peft.PeftModel.from_pretrained(base, adir).eval()
    got_ad = {n: t for n, t in pm.named_parameters() if ".lora_" in n or ".modules_to_save." in n}
    same = sorted(got_ad) == sorted(lora) and all(torch.equal(got_ad[n].float(), lora[n].float()) for n in lora)
    check(f"peft loads every adapter tensor as trained ({len(lora)} tensors)", same,
          f"{sorted(set(got_ad) ^ set(lora))[:4]}")
    moved = all(float(t.detach().abs().max()) > 0 for n, t in lora.items() if ".lora_B." in n)
    check("the trained lora_B tensors moved off their zero start", moved)
    with torch.no_grad(), pm.disable_adapter():  # the adapters matter, so the two logits checks can fail
        plain = pm(input_ids=tokens, position_ids=pos, use_cache=False).logits.float()
    off = float((plain - want).abs().max() / want.abs().max())
    check(f"the base model alone is off mfsdp's logits (max relative {off:.2e} > 1e-04)", off > 1e-4)
    with torch.no_grad():
        got = pm(input_ids=tokens, position_ids=pos, use_cache=False).logits.float()
    rel = float((got - want).abs().max() / want.abs().max())
    check(f"logits of the base model with the adapter equal mfsdp's trained model's (max relative {rel:.2e}, "
          "tolerance 1e-05)", rel <= 1e-5)
    saved = load_file(os.path.join(adir, "adapter_model.safetensors"))
    check("adapter keys are PEFT's (the adapter name taken out)", all(".default." not in k for k in saved) and
          len(saved) == len(lora), str(sorted(saved)[:2]))
    # --only-trainable --format safetensors: the trained tensors under the model file's own names.
    flat = os.path.join(a.work, "trainable.safetensors")
    c = [a.mfsdp, "export", "--checkpoint", a.checkpoint, "--format", "safetensors", "--only-trainable", "--out", flat]
    p = subprocess.run(c, capture_output=True, text=True)
    check("export --only-trainable --format safetensors succeeds", p.returncode == 0, p.stderr.strip()[-300:])
    if p.returncode == 0:
        got = load_file(flat)
        check(f"--only-trainable --format safetensors holds exactly the trained adapters ({len(got)} tensors, as trained)",
              sorted(got) == sorted(lora) and all(torch.equal(got[n].float(), lora[n].detach().float()) for n in lora),
              f"{sorted(set(got) ^ set(lora))[:4]}")
    c = [a.mfsdp, "export", "--checkpoint", a.checkpoint, "--format", "torchscript", "--only-trainable", "--out",
         os.path.join(a.work, "refused.pt")]
    p = subprocess.run(c, capture_output=True, text=True)
    check("--only-trainable --format torchscript is refused (exit 2, naming the formats that take it)",
          p.returncode == 2 and "with --format safetensors" in p.stderr and not os.path.exists(c[-1]),
          f"exit {p.returncode}: {p.stderr.strip()[-200:]}")


if __name__ == "__main__":
    main()
