#!/bin/bash
# Is the backward Gluon code unchanged? Compiles every dK/dV kernel of
# tools/gluon_sass_report.py (warp-specialized D 64 m128 s2, D 64 m64 s3, D 128 m64 s3, D 256
# m64n64 s2; without warp specialization the registry's three; the persistent warp-specialized
# kernel at D 64 m128 s2, D 128 m64 s3, D 256 m64n64 s2; and, under notma/, the warp-specialized
# one-tile and persistent kernels without the dQ TMA (SHAPES dq_tma=0: the writers' red.v4 path)),
# bf16 and fp16, spec and launch, once with src/fmha/kernels/bwd_gluon.py as at REF and once as in
# the working tree (the same path, so the debug information names the same file), and compares PTX
# and SASS per kernel (bf16 and fp16 compile side by side).
#
#     tools/bwd_sass_identity.sh [REF]        (default HEAD; dumps under ${OUT:-/tmp/bwd_sass_identity})
#
# PTX "differs" with SASS "same" is expected where only line numbers and inlining debug info moved.
# ptxas is not deterministic for every kernel: the same PTX compiled concurrently gave one of two
# SASS for the plain D=256 kernel; so where the PTX is identical and the SASS is
# not, run ptxas on that PTX a few times (the line printed says how) before suspecting the change.
# The script does that itself: where 8 more runs of ptxas on the PTX give both SASS, the line says
# `sass:same(ptxas: ...)`. (Compiling bf16 and fp16 side by side, the plain D=128 and D=256
# kernels gave either of two SASS, also from ptxas run alone on the same PTX.)
set -euo pipefail
ref=${1:-HEAD}
out=${OUT:-/tmp/bwd_sass_identity}
cd "$(git rev-parse --show-toplevel)"
file=src/fmha/kernels/bwd_gluon.py
python=${PYTHON:-python}
rm -rf "$out" && mkdir -p "$out/ref" "$out/tree"
cp "$file" "$out/working_copy.py"
restore() { cp "$out/working_copy.py" "$file"; }
trap restore EXIT
ws_variants=64:128:128:2,64:64:128:3,128:64:128:3,256:64:64:2
persistent_variants=64:128:128:2,128:64:128:3,256:64:64:2
compile_dtype() {  # DIR DTYPE
  local d=$1 dt=$2
  report() { PYTHONPATH=src $python tools/gluon_sass_report.py --dtype "$dt" "$@"; }
  report --ws --dump "$d" --variants $ws_variants > "$d/ws_$dt.txt" 2>&1
  report --dump "$d" > "$d/plain_$dt.txt" 2>&1
  report --ws --persistent --dump "$d" --variants $persistent_variants > "$d/persistent_$dt.txt" 2>&1
  report --ws --shape dq_tma=0 --dump "$d/notma" --variants $ws_variants > "$d/notma_ws_$dt.txt" 2>&1
  report --ws --persistent --shape dq_tma=0 --dump "$d/notma" --variants $persistent_variants \
    > "$d/notma_persistent_$dt.txt" 2>&1
}
compile() {  # the two dtypes side by side; a failed report stops the script
  compile_dtype "$1" bf16 & local bf16=$!
  compile_dtype "$1" fp16 & local fp16=$!
  wait $bf16 && wait $fp16
}
git show "$ref:$file" > "$file"
compile "$out/ref"
restore
compile "$out/tree"
bin=$($python -c "import pathlib, triton; print(pathlib.Path(triton.__file__).parent / 'backends/nvidia/bin')")
for ptx in "$out"/ref/*.ptx "$out"/ref/notma/*.ptx; do
  name=${ptx#"$out"/ref/}; name=${name%.ptx}
  p=same; cmp -s "$ptx" "$out/tree/$name.ptx" || p=differs
  s=same; cmp -s "$out/ref/$name.sass" "$out/tree/$name.sass" || s=DIFFERS
  if [ "$p" = same ] && [ "$s" = DIFFERS ]; then  # ptxas run again on the PTX: does it give both SASS?
    want="$(md5sum < "$out/ref/$name.sass" | cut -c1-32) $(md5sum < "$out/tree/$name.sass" | cut -c1-32)"
    seen=""
    for i in 1 2 3 4 5 6 7 8; do
      $bin/ptxas -arch=sm_90a -lineinfo -O3 "$ptx" -o "$out/again.cubin"
      seen="$seen $($bin/cuobjdump -sass "$out/again.cubin" | md5sum | cut -c1-32)"
    done
    both=yes; for h in $want; do [[ $seen == *$h* ]] || both=no; done
    [ $both = yes ] && s="same(ptxas: both SASS again from this PTX in 8 runs)"
  fi
  echo "$name ptx:$p sass:$s"
  if [ "$p" = same ] && [ "$s" = DIFFERS ]; then
    echo "    (same PTX: try $bin/ptxas -arch=sm_90a -lineinfo -O3 $ptx -o /tmp/x.cubin; $bin/cuobjdump -sass /tmp/x.cubin | md5sum)"
  fi
done
