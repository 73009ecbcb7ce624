#!/bin/bash
# Is the one-tile backward Gluon code unchanged? Compiles every dK/dV kernel of
# tools/gluon_sass_report.py (warp-specialized D 64 m128 s2, D 64 m64 s3, D 128 m64 s3, D 256
# m64n64 s2; without warp specialization the registry's three), bf16 and fp16, spec and launch,
# once with src/fmha/kernels/bwd_gluon.py as at REF and once as in the working tree (the same
# path, so the debug information names the same file), and compares PTX and SASS per kernel.
#
#     tools/bwd_sass_identity.sh [REF]        (default HEAD; dumps under ${OUT:-/tmp/bwd_sass_identity})
#
# PTX "differs" with SASS "same" is expected where only line numbers and inlining debug info moved.
# ptxas is not deterministic for every kernel: the same PTX compiled concurrently gave one of two
# SASS for the plain D=256 kernel (2026-11-30); so where the PTX is identical and the SASS is
# not, run ptxas on that PTX a few times (the line printed says how) before suspecting the change.
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
compile() {
  for dt in bf16 fp16; do
    PYTHONPATH=src $python tools/gluon_sass_report.py --ws --dtype $dt --dump "$1" \
      --variants 64:128:128:2,64:64:128:3,128:64:128:3,256:64:64:2 > "$1/ws_$dt.txt" 2>&1
    PYTHONPATH=src $python tools/gluon_sass_report.py --dtype $dt --dump "$1" > "$1/plain_$dt.txt" 2>&1
  done
}
git show "$ref:$file" > "$file"
compile "$out/ref"
restore
compile "$out/tree"
bin=$($python -c "import pathlib, triton; print(pathlib.Path(triton.__file__).parent / 'backends/nvidia/bin')")
for ptx in "$out"/ref/*.ptx; do
  name=$(basename "$ptx" .ptx)
  p=same; cmp -s "$ptx" "$out/tree/$name.ptx" || p=differs
  s=same; cmp -s "$out/ref/$name.sass" "$out/tree/$name.sass" || s=DIFFERS
  echo "$name ptx:$p sass:$s"
  if [ "$p" = same ] && [ "$s" = DIFFERS ]; then
    echo "    (same PTX: try $bin/ptxas -arch=sm_90a -lineinfo -O3 $ptx -o /tmp/x.cubin; $bin/cuobjdump -sass /tmp/x.cubin | md5sum)"
  fi
done
