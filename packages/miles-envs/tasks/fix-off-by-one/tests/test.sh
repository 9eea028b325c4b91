#!/bin/sh
# Exit status 0 = the task is solved. Runs from the sandbox root.
exec python3 - <<'CHECK'
import subprocess
for n, want in ((1, 1), (4, 10), (10, 55)):
    out = subprocess.run(['python3', 'sum_to.py', str(n)], capture_output=True, text=True).stdout.strip()
    assert out == str(want), (n, out)
print('ok')
CHECK
