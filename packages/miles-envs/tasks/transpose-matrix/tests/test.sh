#!/bin/sh
# Exit status 0 = the task is solved. Runs from the sandbox root.
exec python3 - <<'CHECK'
assert open('transposed.txt').read().split('\n')[:4] == ['1 4 7 10', '2 5 8 11', '3 6 9 12', '']
print('ok')
CHECK
