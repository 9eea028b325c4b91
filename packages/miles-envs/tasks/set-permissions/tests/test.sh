#!/bin/sh
# Exit status 0 = the task is solved. Runs from the sandbox root.
exec python3 - <<'CHECK'
import os, stat
assert os.stat('scripts/run.sh').st_mode & stat.S_IXUSR
assert stat.S_IMODE(os.stat('data/secret.txt').st_mode) == 0o600
print('ok')
CHECK
