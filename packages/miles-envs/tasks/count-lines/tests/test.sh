#!/bin/sh
# Exit status 0 = the task is solved. Runs from the sandbox root.
exec python3 - <<'CHECK'
assert open('count.txt').read().strip() == '37'
print('ok')
CHECK
