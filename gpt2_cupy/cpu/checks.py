"""The teaching checks, off by default: switched on per call, by a `with` block, or by GPT2_CUPY_CHECKS.

    bounds  an out-of-bounds read or write of an array argument (its whole allocation, for a view) is reported
            with kernel, block and thread; so is one far before the block's shared memory (one past its end is
            reported with the checks off too, as a GPU stops there)
    races   the launch runs again with every memory access checked: two threads touching one place with no
            barrier or atomic between them (a missing __syncthreads(), a lost `x += 1`) are reported
"""

import contextlib
import os

_ENV = "GPT2_CUPY_CHECKS"
_switched_on = {"bounds": False, "races": False}


def wanted(bounds_per_call, races_per_call):
    """(bounds, races): which checks run for this launch. A per-call True/False wins over the rest."""
    from_environment = os.environ.get(_ENV, "")
    words = {word.strip().lower() for word in from_environment.split(",")} if from_environment else ()
    bounds = _switched_on["bounds"] or "bounds" in words or "all" in words
    races = _switched_on["races"] or "races" in words or "all" in words
    return (bounds if bounds_per_call is None else bool(bounds_per_call),
            races if races_per_call is None else bool(races_per_call))


@contextlib.contextmanager
def launch_checks(bounds=False, races=False):
    """Within the block, launches run with the checks asked for (on top of those already on)."""
    before = dict(_switched_on)
    _switched_on["bounds"] = before["bounds"] or bool(bounds)
    _switched_on["races"] = before["races"] or bool(races)
    try:
        yield
    finally:
        _switched_on.update(before)
