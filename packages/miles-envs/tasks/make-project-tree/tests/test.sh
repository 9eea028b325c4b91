#!/bin/sh
# Exit status 0 = the task is solved. Runs from the sandbox root.
exec python3 - <<'CHECK'
import os
assert os.path.isdir('project/src') and os.path.isdir('project/tests')
assert os.path.isfile('project/README.md')
print('ok')
CHECK
