#!/usr/bin/env python3
"""scripts/hf_shrink_config.py does what its docstring says (tests/hf/hf_tests.cmake):

    check_shrink_config.py SRC WORK

For a dense family (llama) and one with multi-head latent attention and experts (deepseek_v3):
every key of transformers' default config is kept, the sizes are the sweep's, per-layer lists are
cut to two layers, MLA's head sizes are consistent; and scripts/export_hf.py exports the result
(the shrunk config builds a model). Exit 1 naming what differs."""
import json
import os
import subprocess
import sys

src, work = sys.argv[1], sys.argv[2]
py = sys.executable
subprocess.run([py, os.path.join(src, "scripts/hf_shrink_config.py"), work, "llama", "deepseek_v3", "olmo_hybrid",
                "zaya"], check=True, stdout=subprocess.DEVNULL)
from transformers import CONFIG_MAPPING  # noqa: E402

bad = []
for fam in ("llama", "deepseek_v3"):
    got = json.load(open(os.path.join(work, fam, "config.json")))
    default = CONFIG_MAPPING[fam]().to_dict()
    missing = [k for k in default if k not in got and k not in ("transformers_version", "architectures", "_name_or_path")]
    if missing:
        bad.append(f"{fam}: keys dropped: {missing[:5]}")
    want = dict(vocab_size=264, hidden_size=64, num_hidden_layers=2, num_attention_heads=4)
    bad += [f"{fam}: {k} {got.get(k)}, expected {v}" for k, v in want.items() if got.get(k) != v]
    for k, v in got.items():
        if isinstance(v, list) and isinstance(default.get(k), list) and len(default[k]) == default["num_hidden_layers"] \
                and len(v) != 2:
            bad.append(f"{fam}: per-layer list {k} has {len(v)} entries, expected 2")
ds = json.load(open(os.path.join(work, "deepseek_v3", "config.json")))
if ds["qk_head_dim"] != ds["qk_nope_head_dim"] + ds["qk_rope_head_dim"] or ds["num_key_value_heads"] != ds["num_attention_heads"]:
    bad.append(f"deepseek_v3: MLA sizes inconsistent: {[ds[k] for k in ('qk_head_dim', 'qk_nope_head_dim', 'qk_rope_head_dim', 'num_key_value_heads', 'num_attention_heads')]}")
if ds.get("n_routed_experts") != 4 or ds.get("num_experts_per_tok") != 2:
    bad.append(f"deepseek_v3: experts {ds.get('n_routed_experts')} x top-{ds.get('num_experts_per_tok')}, expected 4 x top-2")
p = subprocess.run([py, os.path.join(src, "scripts/export_hf.py"), "--model-dir", os.path.join(work, "deepseek_v3"),
                    "--random-init", "--out", os.path.join(work, "deepseek_v3.pt")], capture_output=True, text=True)
if p.returncode != 0:
    bad.append("export_hf.py of the shrunk deepseek_v3 failed: " + p.stderr.strip().splitlines()[-1])
# The kept layers hold every kind the config names (OLMo-Hybrid: linear attention, then its first
# full attention); a top-k is never raised (ZAYA allows one expert per token); special token ids
# fall inside the cut vocabulary.
oh = json.load(open(os.path.join(work, "olmo_hybrid", "config.json")))
if sorted(oh["layer_types"]) != ["full_attention", "linear_attention"]:
    bad.append(f"olmo_hybrid: kept layer types {oh['layer_types']}, expected one linear and one full attention")
if oh.get("pad_token_id") is not None and oh["pad_token_id"] >= 264:
    bad.append(f"olmo_hybrid: pad_token_id {oh['pad_token_id']} outside the vocabulary of 264")
zy = json.load(open(os.path.join(work, "zaya", "config.json")))
if zy.get("num_experts_per_tok") != CONFIG_MAPPING["zaya"]().num_experts_per_tok:
    bad.append(f"zaya: num_experts_per_tok {zy.get('num_experts_per_tok')} changed from the default's")
for b in bad:
    print("FAIL", b)
print("ok   hf_shrink_config.py: keys kept, sizes cut, MLA consistent, layer kinds kept, top-k and token ids in range, the result exports" if not bad else "")
sys.exit(1 if bad else 0)
