"""Hypothesis profiles for the unit tests.

``GPUD_HYPOTHESIS_PROFILE=mutation`` (set by tools/mutation.py) runs each property test
without shrinking and with a fixed seed: a mutant is killed by the first failing example,
and the same mutant always meets the same examples.
"""

from __future__ import annotations

import os

from hypothesis import Phase, settings

settings.register_profile(
    "mutation",
    phases=[Phase.explicit, Phase.reuse, Phase.generate],
    derandomize=True,
    database=None,
)
settings.load_profile(os.environ.get("GPUD_HYPOTHESIS_PROFILE", "default"))
