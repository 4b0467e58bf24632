"""``python -m gossiploco``: the CLI. Ctrl+C while the CLI itself is still being imported (torch
takes seconds) exits like Ctrl+C anywhere else: code 130, no traceback."""

import sys

try:
    from gossiploco.cli import app
except KeyboardInterrupt:
    sys.exit(130)

app()
