"""Checking tools: the numerics rule (error bounds against the float64 reference), the
numerics study and the sweep/stress harness used by the CLI and the tests."""
