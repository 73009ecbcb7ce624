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

    # Edit: a smaller tile for the forward kernel of this device: the query tile of a Triton
    # config, or (on Hopper, where the first fp16 forward config is the Gluon kernel, whose
    # query tile is fixed at two or three warpgroups of 64 rows) the key tile.
    arch = "cpu" if DEVICE == "cpu" else None
    entry = next(e for e in data["configs"] if e["signature"]["family"] == "fwd"
                 and (arch in e["signature"]["archs"] if arch else "cpu" not in e["signature"]["archs"])
                 and "fp16" in e["signature"]["dtypes"])
    gluon = entry["algorithm"].get("pipeline", "triton") != "triton"
    field, value = ("block_n", 64) if gluon else ("block_m", 16)
    entry["algorithm"][field] = value
    del entry["name"]  # the name is derived from the fields; a stale one is refused
    edited = fmha.Registry.from_json(json.dumps(data))
    edited_name = next(c.name for c in edited if getattr(c.algorithm, field) == value and c.family.value == "fwd")
    print(f"  edited config: {edited_name}")

    gen = torch.Generator().manual_seed(6)
    q, k, v = qkv(*sizes((1, 2, 2, 40, 40, 32), (2, 8, 8, 1024, 1024, 64)), gen=gen)
    fmha.set_dispatcher(fmha.Dispatcher(edited))
    try:
        plan = fmha.get_dispatcher().plan_forward(fmha.problem_of(q, k, v))
        print(f"  plan with the edited registry: {plan.config(fmha.Family.FWD).name}")
        assert getattr(plan.config(fmha.Family.FWD).algorithm, field) == value
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
