"""yatt-apps: production RL jobs composed from the YATT packages, and the `yatt` command.

Apps are leaves: they import the packages, nothing imports them. Each job's RL step is one visible function.
"""

from importlib.metadata import version as _version

__version__ = _version("yatt-apps")
