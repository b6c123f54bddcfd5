#!/usr/bin/env bash
# MKL's sgemm with its own choice of kernels against its kernels chosen by instruction set (the
# answer to its vendor check that mfsdp's binary gives, lib/train/system.cpp), on the products of
# one bench/train_step.sh step (1024 tokens, d 256, MLP 1024, q/k/v packed: forward Y = X W^T,
# backward dX = dY W and dW = dY^T X), one thread, in alternating processes. Meaningful on CPUs not
# made by Intel (on Intel's both columns are MKL's own choice). Writes bench/results_mkl_dispatch.md.
#   bench/mkl_dispatch.sh [ROUNDS]
set -euo pipefail
cd "$(dirname "$0")/.."
ROUNDS=${1:-3}
PY=.venv/bin/python
W=$(mktemp -d)
trap 'rm -rf "$W"' EXIT
echo 'int mkl_serv_intel_cpu_true(void) { return 1; }' > "$W/isa.c"
cc -shared -fPIC -O2 "$W/isa.c" -o "$W/libisa.so"
cat > "$W/products.py" <<'PYEOF'
import ctypes, os, time, torch
torch.set_num_threads(1)
lib = ctypes.CDLL(os.path.join(os.path.dirname(torch.__file__), "lib", "libtorch_cpu.so"))
T, d = 1024, 256
def best_of(f, repeats=5, calls=10):
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(calls):
            f()
        best = min(best, (time.perf_counter() - t0) / calls)
    return best
flops = seconds = 0.0
for n_out, n_in in [(3 * d, d), (d, d), (4 * d, d), (d, 4 * d)]:  # c_attn, attn c_proj, c_fc, mlp c_proj
    x, w, dy = torch.randn(T, n_in), torch.randn(n_out, n_in), torch.randn(T, n_out)
    for f in (lambda: x @ w.t(), lambda: dy @ w, lambda: dy.t() @ x):
        for _ in range(3):
            f()
        seconds += best_of(f)
        flops += 2.0 * T * n_out * n_in
print(f"{1000 * seconds:.3f} {flops / seconds / 1e9:.1f} {lib.mkl_serv_cpu_detect()}")
PYEOF
rows=()
for r in $(seq "$ROUNDS"); do
  own=$("$PY" "$W/products.py")
  isa=$(LD_PRELOAD="$W/libisa.so" "$PY" "$W/products.py")
  read -r own_ms own_gf own_path <<< "$own"
  read -r isa_ms isa_gf isa_path <<< "$isa"
  rows+=("| $r | $own_ms ms, $own_gf GFLOP/s (code path $own_path) | $isa_ms ms, $isa_gf GFLOP/s (code path $isa_path) | $(python3 -c "print(f'{$isa_ms/$own_ms:.2f}')") |")
done
{
  echo "# MKL's sgemm: its own kernel choice against kernels by instruction set"
  echo
  echo "Written by bench/mkl_dispatch.sh $ROUNDS on $(date -u +%Y-%m-%d) ($(nproc) cores: $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs)," \
       "$(awk -F': *' '/^vendor_id/ { print $2; exit }' /proc/cpuinfo)), torch $("$PY" -c 'import torch; print(torch.__version__)'), one thread."
  echo "The twelve products of one bench/train_step.sh GPT layer (forward and both backward products of its four linears,"
  echo "1024 tokens), best of 5 x 10 calls each, summed. \"code path\" is mkl_serv_cpu_detect() (0: MKL's generic kernels)."
  echo
  echo "| round | MKL's own choice | by instruction set | ratio |"
  echo "|---|---|---|---|"
  printf '%s\n' "${rows[@]}"
} > bench/results_mkl_dispatch.md
cat bench/results_mkl_dispatch.md
