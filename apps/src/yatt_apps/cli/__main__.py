"""`python -m yatt_apps.cli ...`: the `yatt` command."""

import sys

from yatt_apps.cli.main import main

sys.exit(main())
