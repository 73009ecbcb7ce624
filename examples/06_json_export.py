"""Example 06: the kernel registry as JSON (export, edit, import, use).

    python examples/06_json_export.py

A registry is data: each KernelConfig (signature + algorithm) has a stable name and a
JSON form. This exports the default registry, reads it back, edits one config's tile
sizes in the JSON, imports it, runs attention through it (checked), and shows that a
malformed file is refused with a clear message.
"""

import json
import tempfile
from pathlib import Path

import torch

import fmha
from fmha import cli

from _common import DEVICE, done, header, qkv, run_checked, sizes

header("Example 06: registry JSON export / import")
registry = fmha.default_registry()
with tempfile.TemporaryDirectory() as tmp:
    path = Path(tmp) / "registry.json"
    if cli.main(["kernels", "export", str(path)]) != 0:  # same as `fmha kernels export FILE`
        raise AssertionError("fmha kernels export failed")
    data = json.loads(path.read_text())
    print(f"  exported {len(data['configs'])} configs, statistics: {data['statistics']['by_family']}")
    loaded = fmha.Registry.load(path)
    assert [c.name for c in loaded] == [c.name for c in registry], "round trip changed the registry"

    # Edit: a smaller query tile for the forward kernel of this device.
    arch = "cpu" if DEVICE == "cpu" else None
    entry = next(e for e in data["configs"] if e["signature"]["family"] == "fwd"
                 and (arch in e["signature"]["archs"] if arch else "cpu" not in e["signature"]["archs"])
                 and "fp16" in e["signature"]["dtypes"])
    entry["algorithm"]["block_m"] = 16
    del entry["name"]  # the name is derived from the fields; a stale one is refused
    edited = fmha.Registry.from_json(json.dumps(data))
    print(f"  edited config: {[c.name for c in edited if c.algorithm.block_m == 16 and c.family.value == 'fwd'][0]}")

    gen = torch.Generator().manual_seed(6)
    q, k, v = qkv(*sizes((1, 2, 2, 40, 40, 32), (2, 8, 8, 1024, 1024, 64)), gen=gen)
    fmha.set_dispatcher(fmha.Dispatcher(edited))
    try:
        plan = fmha.get_dispatcher().plan_forward(fmha.problem_of(q, k, v))
        print(f"  plan with the edited registry: {plan.config(fmha.Family.FWD).name}")
        assert plan.config(fmha.Family.FWD).algorithm.block_m == 16
        run_checked("attention through the imported registry", q, k, v, causal=True)
    finally:
        fmha.set_dispatcher(None)

    # A malformed file is refused, naming the problem.
    bad = json.loads(path.read_text())
    bad["configs"][0]["algorithm"]["block_m"] = 24
    try:
        fmha.Registry.from_json(json.dumps(bad))
    except fmha.ConfigError as e:
        print(f"  refused as expected: {e}")
    else:
        raise AssertionError("a config with block_m=24 was accepted")
done()
