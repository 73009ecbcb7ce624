export PYTHONPATH=src:tests
timeout 200 python tools/fp8_bench.py $OUT/fp8_sweep_pp.json --sweep --quick --rounds 3 2>&1 | grep -v Warning | grep -v "^{" > $OUT/fp8_sweep_pp.log; cat $OUT/fp8_sweep_pp.log
