#!/usr/bin/env bash
# expect.sh STATUS REGEX -- COMMAND...: run COMMAND, require its exit status to be STATUS and its
# combined output to match the extended regex REGEX (newlines in the output are matched as \n).
set -u
want_status=$1 regex=$2
shift 2
[ "$1" = "--" ] && shift
out=$("$@" 2>&1)
status=$?
printf '%s\n' "$out"
if [ "$status" != "$want_status" ]; then
  echo "expect.sh: exit status $status, expected $want_status" >&2
  exit 1
fi
if ! printf '%s' "$out" | python3 -c 'import re,sys; sys.exit(0 if re.search(sys.argv[1].replace("\\n","\n"), sys.stdin.read(), re.S) else 1)' "$regex"; then
  echo "expect.sh: output does not match: $regex" >&2
  exit 1
fi
