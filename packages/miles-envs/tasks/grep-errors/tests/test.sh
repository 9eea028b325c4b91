#!/bin/sh
# Exit status 0 = the task is solved. Runs from the sandbox root.
exec python3 - <<'CHECK'
assert open('errors.log').read() == 'ERROR disk full\n2 ERROR retry\nERROR done\n'
print('ok')
CHECK
