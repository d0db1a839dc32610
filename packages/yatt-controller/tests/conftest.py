"""Ray settings for this package's tests when pytest runs with the package as its root (the workspace
conftest sets the same when run from the workspace): no auth token under $HOME, no usage stats."""

import os

for _key, _value in {"RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0"}.items():
    os.environ.setdefault(_key, _value)
