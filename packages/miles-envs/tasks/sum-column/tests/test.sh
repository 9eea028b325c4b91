#!/bin/sh
# Exit status 0 = the task is solved. Runs from the sandbox root.
exec python3 - <<'CHECK'
assert open('total.txt').read().strip() == '116.25'
print('ok')
CHECK
