"""yatt-placement: where the roles of an RL job run.

Cluster and role specs, the pure planner (full colocated, partial colocated, disaggregated), the dynamic
re-planner, a step simulator and Ray realization (extra `ray`). Importing this package loads msgspec only.
"""

from importlib.metadata import version as _version

__version__ = _version("yatt-placement")
