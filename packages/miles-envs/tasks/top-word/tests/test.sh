#!/bin/sh
# Exit status 0 = the task is solved. Runs from the sandbox root.
exec python3 - <<'CHECK'
assert open('top.txt').read().strip() == 'apple'
print('ok')
CHECK
