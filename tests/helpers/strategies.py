"""Hypothesis strategies the property tests share."""
from __future__ import annotations

from hypothesis import strategies as st

# Any value a JSON (or YAML) file can hold, NaN included, nested a little.
ANY_JSON = st.recursive(st.none() | st.booleans() | st.integers(-3, 10**6) | st.floats(allow_nan=True)
                        | st.text(max_size=8), lambda inner: st.lists(inner, max_size=3)
                        | st.dictionaries(st.text(max_size=4), inner, max_size=3), max_leaves=6)
