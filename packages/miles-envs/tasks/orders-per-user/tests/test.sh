#!/bin/sh
# Exit status 0 = the task is solved. Runs from the sandbox root.
exec python3 - <<'CHECK'
assert open('counts.csv').read().split() == ['name,orders', 'kim,2', 'lee,0', 'max,3']
print('ok')
CHECK
