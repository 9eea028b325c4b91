#!/bin/sh
# Exit status 0 = the task is solved. Runs from the sandbox root.
exec python3 - <<'CHECK'
import os, subprocess
assert os.access('greet.sh', os.X_OK)
out = subprocess.run(['./greet.sh', 'zoe'], capture_output=True, text=True).stdout
assert out.strip() == 'hi zoe', out
print('ok')
CHECK
