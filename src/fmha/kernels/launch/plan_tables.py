"""Tables of launch plans, registered so that one call forgets them all (`clear_plans`).

The launchers' plans (kernels/launch_cache.py) and the api's forward call plans (api.py) live
in such tables. Kept apart from launch_cache so that `import fmha` does not import Triton.
"""

from __future__ import annotations

_TABLES: list[dict] = []
PLANS_MAX = 1024  # per table; a full table is cleared


def plan_table() -> dict:
    """A table of plans (key -> plan), registered for `clear_plans`."""
    table: dict = {}
    _TABLES.append(table)
    return table


def keep_plan(table: dict, key, planned) -> None:
    if len(table) >= PLANS_MAX:
        table.clear()
    table[key] = planned


def clear_plans() -> None:
    """Forget every plan (after changing what a plan's maker reads besides its key, e.g. a
    test's monkeypatched tile shapes, or the dispatcher: the keys do not see that)."""
    for table in _TABLES:
        table.clear()
