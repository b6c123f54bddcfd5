#!/usr/bin/env python3
"""export_hf.py's --tp-plan none and --allow-new-keys, as a user gives them (tests/hf/hf_tests.cmake):

    check_export_options.py SRC OUT.pt

exports a small Llama with --tp-plan none and a key LlamaConfig lacks (--set my_extra_key=7
--allow-new-keys), then checks the file: the key is in mfsdp/hf_config.json, there is no
mfsdp/tp_plan.json, and the export's log says why. The TP run refused on that file is the next test.
"""
import contextlib
import io
import json
import os
import sys
import zipfile


def main():
    src, out = sys.argv[1], sys.argv[2]
    sys.path.insert(0, os.path.join(src, "scripts"))
    import export_hf
    log = io.StringIO()
    with contextlib.redirect_stderr(log):
        export_hf.main(["--family", "llama", "--set", "vocab_size=264", "hidden_size=64", "intermediate_size=128",
                        "num_hidden_layers=2", "num_attention_heads=4", "num_key_value_heads=2", "my_extra_key=7",
                        "--allow-new-keys", "--tp-plan", "none", "--out", out])
    names = zipfile.ZipFile(out).namelist()
    cfg = [n for n in names if n.endswith("extra/mfsdp/hf_config.json")]
    failures = []
    if not cfg:
        failures.append("no mfsdp/hf_config.json in the file")
    elif json.loads(zipfile.ZipFile(out).read(cfg[0])).get("my_extra_key") != 7:
        failures.append("mfsdp/hf_config.json lacks my_extra_key: 7 (--allow-new-keys)")
    if any(n.endswith("extra/mfsdp/tp_plan.json") for n in names):
        failures.append("a tp_plan.json was stored despite --tp-plan none")
    if "no tensor-parallel plan (--tp-plan none)" not in log.getvalue():
        failures.append("the export's log does not say why there is no plan:\n" + log.getvalue()[-500:])
    for f in failures:
        print("FAIL " + f)
    if failures:
        sys.exit(1)
    print("ok   --allow-new-keys stored my_extra_key; --tp-plan none stored no plan and said so")


if __name__ == "__main__":
    main()
