"""`from gpt2_cupy import functional as F`: the same module as gpt2_cupy.nn.functional, F's home (as torch's)."""

import sys

from gpt2_cupy.nn import functional

sys.modules[__name__] = functional  # one module under two names: F.Linear, monkeypatching, inspect all agree
