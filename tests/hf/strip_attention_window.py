#!/usr/bin/env python3
"""Copy a model file without the attention_window of its mfsdp/hf_export.json, as a file exported
by an older export_hf.py or by hand carries none (tests/hf/hf_tests.cmake: then the run-time mask
check of the replaced sdpa calls is what refuses context parallelism of a sliding window):

    strip_attention_window.py IN.pt OUT.pt
"""
import json
import sys
import zipfile


def main():
    src, dst = sys.argv[1], sys.argv[2]
    found = False
    with zipfile.ZipFile(src) as zin, zipfile.ZipFile(dst + ".tmp", "w", zipfile.ZIP_STORED) as zout:
        for item in zin.infolist():
            data = zin.read(item)
            if item.filename.endswith("extra/mfsdp/hf_export.json"):
                record = json.loads(data)
                found = record.pop("attention_window", None) is not None
                data = json.dumps(record, indent=1).encode()
            zout.writestr(item, data)
    if not found:
        sys.exit(f"strip_attention_window: {src} records no attention_window")
    import os
    os.replace(dst + ".tmp", dst)


if __name__ == "__main__":
    main()
