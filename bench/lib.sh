# Shared by the bench scripts (sourced): a byte-level Megatron dataset from the license texts every
# Debian machine has, for benchmarks that need no prepared corpus.
#   bench_text_data DIR MFSDP  -> DIR/data.bin + DIR/data.idx
bench_text_data() {
  local dir=$1 mfsdp=$2
  cat /usr/share/common-licenses/GPL-3 /usr/share/common-licenses/Apache-2.0 /usr/share/common-licenses/LGPL-3 \
      /usr/share/common-licenses/MPL-2.0 /usr/share/common-licenses/GPL-2 > "$dir/text.txt"
  "$mfsdp" prepare-data -i "$dir/text.txt" -o "$dir/data" > /dev/null
}
