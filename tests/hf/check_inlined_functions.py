#!/usr/bin/env python3
"""export_hf.py's handling of custom autograd Functions (tests/hf/hf_tests.cmake):

    check_inlined_functions.py SRC OUT_DIR

BLOOM's GeLUFunction (a hand-written backward of its tanh GELU) is traced through its forward, and
the export says so with the measured gradient agreement; the same family with that backward
replaced by a straight-through one (the identity: not the forward's derivative) must fail the
export naming the Function, since mfsdp would train it with the forward's derivative instead.
"""
import contextlib
import io
import os
import sys

ARGS = ["--family", "bloom", "--set", "vocab_size=264", "hidden_size=64", "n_layer=2", "n_head=4"]


def export(export_hf, out):
    log = io.StringIO()
    code = 0
    with contextlib.redirect_stderr(log):
        try:
            export_hf.main(ARGS + ["--out", out])
        except SystemExit as e:
            code = e.code
    return code, log.getvalue()


def main():
    src, out = sys.argv[1], sys.argv[2]
    os.makedirs(out, exist_ok=True)
    sys.path.insert(0, os.path.join(src, "scripts"))
    import export_hf
    from transformers.models.bloom import modeling_bloom
    failures = []
    code, log = export(export_hf, os.path.join(out, "bloom.pt"))
    if code not in (None, 0) or "GeLUFunction traced through their forward; gradients equal" not in log:
        failures.append(f"the plain BLOOM export (exit {code}) does not report its traced GeLUFunction:\n{log[-600:]}")
    fn = modeling_bloom.GeLUFunction
    saved = fn.__dict__["backward"]
    fn.backward = staticmethod(lambda ctx, grad_output: grad_output)
    try:
        code, log = export(export_hf, os.path.join(out, "bloom_ste.pt"))
    finally:
        fn.backward = saved
    want = "GeLUFunction: custom autograd Function(s) whose backward is not their forward's derivative"
    if not isinstance(code, str) or want not in code:
        failures.append(f"a straight-through GeLUFunction was exported (exit {code!r}), expected: {want}")
    if os.path.exists(os.path.join(out, "bloom_ste.pt")):
        failures.append("the refused export left bloom_ste.pt behind")
    for f in failures:
        print("FAIL " + f)
    if failures:
        sys.exit(1)
    print("OK: GeLUFunction traced with its gradients checked; a Function whose backward is not the "
          "derivative is refused: " + code)


if __name__ == "__main__":
    main()
