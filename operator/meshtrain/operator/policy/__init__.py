"""The operator's pure policy: decisions, feasibility, memory admission, conditions, manifests, status shapes.

Values in, values out.  :mod:`.lifecycle` is the state machine: an ordered table of rules drawn
from one module per policy, in the named sections of :mod:`.situation`.
"""
