"""Structured outputs: the wire form of a constraint (spec.py), the grammar engines behind one
interface (backends.py, which import xgrammar / llguidance) and the bounded compile cache (cache.py)."""
