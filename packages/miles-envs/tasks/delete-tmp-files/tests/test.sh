#!/bin/sh
# Exit status 0 = the task is solved. Runs from the sandbox root.
exec python3 - <<'CHECK'
import os
found = sorted(os.path.join(d, f) for d, _, fs in os.walk('work') for f in fs)
assert found == ['work/a.txt', 'work/deep/b.txt'], found
print('ok')
CHECK
