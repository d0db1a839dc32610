"""yatt-controller: the Ray runtime of YATT.

Worker groups, parallel and single controllers, dispatch, weight-sync orchestration, checkpoints and health.
Generic: it hosts any class and runs any step function. Importing this package loads msgspec only; Ray is
imported by the modules that use it.
"""

from importlib.metadata import version as _version

__version__ = _version("yatt-controller")
