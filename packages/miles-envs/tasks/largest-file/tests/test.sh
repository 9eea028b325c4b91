#!/bin/sh
# Exit status 0 = the task is solved. Runs from the sandbox root.
exec python3 - <<'CHECK'
assert open('largest.txt').read().strip() == 'big.bin'
print('ok')
CHECK
