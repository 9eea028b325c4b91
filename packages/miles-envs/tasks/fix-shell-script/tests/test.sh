#!/bin/sh
# Exit status 0 = the task is solved. Runs from the sandbox root.
exec python3 - <<'CHECK'
import os, subprocess
os.makedirs('probe/sub', exist_ok=True)
for name in ('a', 'b', 'c'):
    open(os.path.join('probe', name), 'w').close()
out = subprocess.run(['sh', 'count.sh', 'probe'], capture_output=True, text=True).stdout.strip()
assert out == '3', out
assert subprocess.run(['sh', 'count.sh', 'probe/sub'], capture_output=True, text=True).stdout.strip() == '0'
print('ok')
CHECK
