#!/bin/sh
# Exit status 0 = the task is solved. Runs from the sandbox root.
exec python3 - <<'CHECK'
assert open('port.txt').read().strip() == '5433'
print('ok')
CHECK
