#!/bin/sh
# Exit status 0 = the task is solved. Runs from the sandbox root.
exec python3 - <<'CHECK'
assert open('unique.txt').read().split() == ['amy', 'ben', 'cat', 'dan']
print('ok')
CHECK
